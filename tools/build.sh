#!/usr/bin/env bash
# Installs the dependencies (Debian packages) and builds everything into build/.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
# The PyPI packages of the reference tests (transformers, tokenizers, ...).
python=$(tools/make-venv.sh build/venv)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCOALESCE_PYTHON="$python" "$@" >/dev/null
cmake --build build -j "$(nproc)"
