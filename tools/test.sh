#!/usr/bin/env bash
# Quick start: install, build, and run every test: the fuzzers for a fixed
# time, then the C++ unit tests and the end-to-end tests of the real server
# through a Python gRPC client.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
# The loaders and tokenizers under libFuzzer for a fixed time each.
tools/fuzz.sh "${COALESCE_FUZZ_SECONDS:-20}"
cd build
ctest --output-on-failure -j "$(nproc)" "$@"
