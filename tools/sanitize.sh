#!/usr/bin/env bash
# Builds everything that runs on the CPU with AddressSanitizer (leaks
# included) and UBSan into build-asan/, and runs the tests against it: the
# unit tests, and the end-to-end tests with the instrumented server under its
# Python clients (cancellations, deadlines, preemption, a lost device, drain).
# A memory error, a leak at exit or undefined behaviour fails the run.
# Built with clang and -Werror=thread-safety (tools/configure-asan.sh): every
# file compiled here has its thread-safety annotations checked (what
# tools/thread_safety.sh checks without this build), and clang builds this
# configuration in well under the time GCC takes.
#   tools/sanitize.sh [ctest arguments]
# Left out: the CUDA backend (no GPU here: its tests only skip), tests that
# run no C++ of ours or only repeat what these cover (formatting, deployment
# files, the 4,000-string tokenizer comparison, which the fuzzers cover; the
# SmolLM2 logits comparison, 5 minutes here of a numeric check whose loader,
# tokenizer and model code run instrumented in gguf_model_test, the fuzzers
# and gguf_server_parity), and the soak, whose memory-plateau check AddressSanitizer's quarantine of freed
# memory (up to 256 MiB) would fail by design.
set -euo pipefail
cd "$(dirname "$0")/.."
export COALESCE_PYTHON=${COALESCE_PYTHON:-$(tools/make-venv.sh build/venv)}
build=$(tools/configure-asan.sh)
# Everything, the fuzz targets included (tools/fuzz.sh runs them).
cmake --build "$build" -j "$(nproc)"
cd "$build"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure -j "$(nproc)" -E '^(clang_format|deploy_.*|tokenizer_parity|gguf_model_parity|soak_smoke)$' "$@"
echo "sanitizers: no memory error, leak or undefined behaviour"
