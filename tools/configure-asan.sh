#!/usr/bin/env bash
# Configures build-asan/: everything that runs on the CPU, built by clang with
# AddressSanitizer and UBSan, and the libFuzzer targets (COALESCE_FUZZ). One
# build serves both tools/sanitize.sh (the tests against it) and
# tools/fuzz.sh (the fuzz targets), so the engine is compiled with the
# sanitizers once. COALESCE_PYTHON, where set, is the interpreter of the
# tests that need the venv (tools/make-venv.sh); unset, the build's cached
# choice stays.
#   tools/configure-asan.sh   (prints the build folder)
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-asan
python=()
[[ -n ${COALESCE_PYTHON:-} ]] && python=(-DCOALESCE_PYTHON="$COALESCE_PYTHON")
# -O1 -g1: what AddressSanitizer recommends, and line tables are all its
# reports need; both compile much faster than -O2 -g. -Werror=thread-safety:
# every file compiled here has its thread-safety annotations checked (what
# tools/thread_safety.sh checks without this build).
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOALESCE_CUDA=OFF -DCOALESCE_FUZZ=ON \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  "${python[@]}" \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -Wthread-safety -Werror=thread-safety" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
echo "$build"
