#!/usr/bin/env bash
# Creates (or updates) a Python venv holding the PyPI packages some tests need
# (tests/requirements.txt), and prints its interpreter. The venv is made with
# --system-site-packages from Debian's python3, so Debian's python3-torch,
# numpy, grpcio and pytest (tools/install-deps.sh) stay visible in it.
#   cmake -S . -B build -DCOALESCE_PYTHON="$(tools/make-venv.sh build/venv)"
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-build/venv}"
[ -x "$dir/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$dir"
"$dir/bin/python" -m pip install -q --disable-pip-version-check -r tests/requirements.txt >&2
echo "$(cd "$dir" && pwd)/bin/python"
