#!/usr/bin/env bash
# Quick start: install, build, and run every test: the fuzzers for a fixed
# time, then the C++ unit tests, the end-to-end tests of the real server
# through a Python gRPC client, and the reference checks against Hugging Face
# transformers and tokenizers and a real Prometheus, and the thread-safety
# annotations under clang (tools/thread_safety.sh); then the unit and
# end-to-end tests again with AddressSanitizer and UBSan (tools/sanitize.sh;
# COALESCE_SANITIZE=0 skips it), and the batcher, service and common unit
# tests and the end-to-end tests with ThreadSanitizer (tools/tsan.sh;
# COALESCE_TSAN=0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
# The PyPI packages of the reference tests (tests/requirements.txt) in a venv.
python=$(tools/make-venv.sh build/venv)
tools/build.sh -DCOALESCE_PYTHON="$python"
# The loaders and tokenizers under libFuzzer for a fixed time each.
tools/fuzz.sh "${COALESCE_FUZZ_SECONDS:-20}"
(cd build && ctest --output-on-failure -j "$(nproc)" "$@")
# The thread-safety annotations, through clang's -Wthread-safety.
tools/thread_safety.sh build
if [[ ${COALESCE_SANITIZE:-1} != 0 ]]; then
  COALESCE_PYTHON="$python" tools/sanitize.sh "$@"
fi
if [[ ${COALESCE_TSAN:-1} != 0 ]]; then
  COALESCE_PYTHON="$python" tools/tsan.sh "$@"
fi
