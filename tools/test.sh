#!/usr/bin/env bash
# Quick start: install, build, and run every test: the C++ unit tests, the
# end-to-end tests of the real server through a Python gRPC client, and the
# reference checks against Hugging Face transformers and tokenizers and a real
# Prometheus; then the unit and end-to-end tests again with AddressSanitizer
# and UBSan (tools/sanitize.sh, whose clang build also checks the
# thread-safety annotations; COALESCE_SANITIZE=0 skips it and runs
# tools/thread_safety.sh instead), the fuzzers for a fixed time each, built
# in that same build (tools/fuzz.sh), and the batcher, service and common
# unit tests and the end-to-end tests with ThreadSanitizer (tools/tsan.sh;
# COALESCE_TSAN=0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's wall time, printed as it ends and summed up at the end.
phases=()
phase() {
  local name=$1 t=$SECONDS
  shift
  "$@"
  phases+=("$name $((SECONDS - t)) s")
  echo "test.sh: $name took $((SECONDS - t)) s"
}
phase install-deps tools/install-deps.sh
# The PyPI packages of the reference tests (tests/requirements.txt) in a venv.
t=$SECONDS
python=$(tools/make-venv.sh build/venv)
phases+=("venv $((SECONDS - t)) s")
phase build tools/build.sh -DCOALESCE_PYTHON="$python"
phase ctest ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
if [[ ${COALESCE_SANITIZE:-1} != 0 ]]; then
  # Its clang build checks the thread-safety annotations as it compiles.
  COALESCE_PYTHON="$python" phase asan tools/sanitize.sh "$@"
else
  # The thread-safety annotations, through clang's -Wthread-safety.
  phase thread-safety tools/thread_safety.sh build
fi
# The loaders, tokenizers, chat templates and tenants file under libFuzzer
# for a fixed time each, built in the AddressSanitizer build above (alone,
# with COALESCE_SANITIZE=0, it builds only the fuzz targets there).
COALESCE_PYTHON="$python" phase fuzz tools/fuzz.sh "${COALESCE_FUZZ_SECONDS:-20}"
if [[ ${COALESCE_TSAN:-1} != 0 ]]; then
  COALESCE_PYTHON="$python" phase tsan tools/tsan.sh "$@"
fi
echo "test.sh: all passed in $SECONDS s (${phases[*]})"
