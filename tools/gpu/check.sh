#!/usr/bin/env bash
# The GPU check. On a machine with an NVIDIA GPU, the CUDA toolkit, CMake and a
# C++ compiler (and nothing else: no gRPC, Protobuf, prometheus-cpp or
# network), from the repository root:
#
#   tools/gpu/check.sh
#
# builds the engine alone with its CUDA backend, its CUDA tests and
# coalesce-gpu-bench; runs the kernel tests against the CPU arithmetic; runs
# the backend tests (logits against the CPU backend, stories260K's goldens in
# FP32 exactly and in BF16 as agreement, a batch against the same requests
# alone, graphs against eager steps); then benchmarks the 1B and 8B shapes,
# and the engine loop with and without --overlap_steps (coalesce-loop-bench).
# Then the server itself, over gRPC with --device=cuda: the end-to-end tests
# (tests/service, FP32, stories260K's goldens through the server, a batch
# against the same requests alone, cancellation, deadlines, preemption, bad
# input, metrics, drain) under this machine's Python and grpcio, and the
# service's cost (tools/bench/service_cost.sh: the server against its own
# engine on the 1B shape at 64 streams). The summary comes last. Logs go to
# $OUT (or build-gpucheck/out), and all it prints to check.txt there too.
# Exit status: 0 when every step passed, 1 when one failed, 2 without
# .gpucheck/.
#
# What the machine lacks comes in .gpucheck/, which tools/gpu/prepare.sh fills
# on a development machine: Abseil (headers and shared libraries), the
# googletest sources, stories260K, the server (built on that machine, with
# the libraries it needs), the gRPC API's descriptors for the tests' client,
# and the commit being checked. (Debian's Abseil headers predate GCC 13, which
# no longer pulls <cstdint> in through other headers: hence the forced
# include.)
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=${OUT:-$root/build-gpucheck/out}
mkdir -p "$out"
if [[ ! -d .gpucheck/absl || ! -d .gpucheck/models/stories260K ]]; then
  echo "check.sh: .gpucheck/ is missing or incomplete; run tools/gpu/prepare.sh first" >&2
  exit 2
fi
# All it prints also goes to $out/check.txt, which tools/gpu/record.sh reads.
exec > >(tee "$out/check.txt") 2>&1

summary=()
failed=0  # the exit status: 1 once a step fails
step() {  # step NAME COMMAND...: runs it, logs to $out/NAME.log, records the outcome
  local name=$1
  shift
  local start=$SECONDS
  echo "=== $name: $*"
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-14s %-4s %4ds' "$name" "$([[ $rc == 0 ]] && echo ok || echo FAIL)" $((SECONDS - start)))")
  [[ $rc == 0 ]] || failed=1
  return $rc
}

{
  echo "date:    $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit:  $(cat .gpucheck/COMMIT 2>/dev/null || echo unknown)"
  echo "command: tools/gpu/check.sh"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv,noheader 2>&1 | sed 's/^/gpu:     /'
  echo "nvcc:    $(nvcc --version 2>/dev/null | tail -1)"
  echo "c++:     $(c++ --version | head -1)"
} | tee "$out/environment.txt"

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if step configure cmake -S . -B build-gpucheck "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCOALESCE_ENGINE_ONLY=ON -DCOALESCE_HF_FORMATS=OFF -DCOALESCE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 \
  "-DCMAKE_CXX_FLAGS=-include cstdint" \
  -DCMAKE_PREFIX_PATH="$root/.gpucheck/absl" \
  -DCOALESCE_GTEST_SOURCE="$root/.gpucheck/googletest" \
  -DCOALESCE_MODELS_DIR="$root/.gpucheck/models" &&
  step build cmake --build build-gpucheck -j"$(nproc)" \
    --target cuda_kernels_test cuda_backend_test backend_contract_test coalesce-gpu-bench \
    coalesce-loop-bench; then
  export LD_LIBRARY_PATH="$root/.gpucheck/absl/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Time limits, so that a hang cannot eat the machine's whole lease.
  step kernel_tests timeout 180 build-gpucheck/bin/cuda_kernels_test \
    --gtest_output="xml:$out/kernels.xml"
  step backend_tests timeout 240 build-gpucheck/bin/cuda_backend_test \
    --gtest_output="xml:$out/backend.xml"
  # The backend contract, against the CPU, null and CUDA backends.
  step contract_tests timeout 240 build-gpucheck/bin/backend_contract_test \
    --gtest_output="xml:$out/contract.xml"
  step bench timeout 300 build-gpucheck/bin/coalesce-gpu-bench
  # The engine loop with and without --overlap_steps on the GPU (host work
  # per streamed token as in the server).
  step loop timeout 120 build-gpucheck/bin/coalesce-loop-bench --device=cuda \
    --model=synthetic:110m --batch=64 --tokens=64 --rounds=3
else
  for log in "$out/configure.log" "$out/build.log"; do
    [[ -f $log ]] && tail -n 40 "$log"
  done
fi

# The server over gRPC (it does not need the engine build above). A fixed
# KV cache per server: the tests keep several servers up at once, and the
# default takes 0.9 of the memory the ones before left free.
if [[ -x .gpucheck/server/bin/coalesce-server ]]; then
  step server_e2e timeout 300 env COALESCE_SERVER="$root/.gpucheck/server/bin/coalesce-server" \
    COALESCE_MODELS_DIR="$root/.gpucheck/models" COALESCE_E2E_DESCRIPTORS="$root/.gpucheck/e2e.desc" \
    COALESCE_SERVER_FLAGS="--device=cuda --dtype=fp32 --kv_cache_memory=1GiB" \
    python3 -m pytest -q -rA -p no:cacheprovider tests/service/test_server_e2e.py \
    tests/service/test_pressure_e2e.py tests/service/test_prefix_cache_e2e.py \
    tests/service/test_samples_e2e.py
  step service_cost timeout 240 env SERVICE_COST_DEVICE=cuda SERVICE_COST_MODEL=synthetic:1b \
    SERVICE_COST_SECONDS=10 SERVICE_COST_ENGINE_REPEAT=3 tools/bench/service_cost.sh .gpucheck/server
else
  echo "check.sh: no .gpucheck/server (tools/gpu/prepare.sh makes it): the server is not checked"
fi

echo
for log in kernel_tests backend_tests; do
  [[ -f $out/$log.log ]] && grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|Failure|relative error|goldens|decode the same|cuda:' "$out/$log.log" | head -40
done
[[ -f $out/bench.log ]] && cat "$out/bench.log"
[[ -f $out/loop.log ]] && echo && cat "$out/loop.log"
if [[ -f $out/server_e2e.log ]]; then
  echo
  echo "## The server over gRPC on the GPU: tests/service with --device=cuda --dtype=fp32 --kv_cache_memory=1GiB"
  grep -E '^(PASSED|FAILED|ERROR|SKIPPED) |^=* *[0-9]+ (passed|failed|error)' "$out/server_e2e.log"
fi
[[ -f $out/service_cost.log ]] && echo && cat "$out/service_cost.log"
echo
echo "summary:"
printf '  %s\n' "${summary[@]}"
exit $failed
