#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, AddressSanitizer, UBSan) and runs each
# for a fixed time, as many at once as there are cores. Any crash or
# sanitizer report fails the run.
#   tools/fuzz.sh [seconds per target, default 20]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
# The fuzz targets live in the AddressSanitizer build (tools/configure-asan.sh),
# which tools/sanitize.sh builds whole; alone, this builds only them. The
# code they feed bytes to (the loaders, tokenizers and chat templates) is
# compiled with coverage for libFuzzer (engine/CMakeLists.txt). The fuzzed
# loaders run on the CPU: the CUDA backend is left out.
build=$(tools/configure-asan.sh)
targets=$(sed -n 's/^coalesce_fuzzer(\(.*\))$/\1/p' tests/fuzz/CMakeLists.txt)
cmake --build "$build" -j "$(nproc)" --target $targets
# One target a core at a time, each with its own log; a failure prints its
# log's end, the others their last lines.
fuzz_one() {
  local t=$1 seeds=()
  mkdir -p "$build/corpus/$t"
  # New inputs go to the first folder (the build's); the checked-in seeds of
  # tests/fuzz/corpus/<target>, where there are any, are only read.
  [ -d "tests/fuzz/corpus/$t" ] && seeds=("tests/fuzz/corpus/$t")
  if "$build/bin/$t" -max_total_time="$seconds" -rss_limit_mb=4096 -artifact_prefix="$build/" \
    "$build/corpus/$t" "${seeds[@]}" >"$build/$t.log" 2>&1; then
    echo "== $t: ${seconds}s"
    tail -n 3 "$build/$t.log"
  else
    echo "== $t: FAILED (the end of $build/$t.log)"
    tail -n 80 "$build/$t.log"
    return 1
  fi
}
export -f fuzz_one
export build seconds
# shellcheck disable=SC2086
printf '%s\n' $targets | xargs -P "$(nproc)" -I{} bash -c 'fuzz_one {}'
echo "fuzzing: no crash, no sanitizer report"
