#!/usr/bin/env bash
# Quick start: install, build, and run every test (C++ unit tests and the
# end-to-end tests of the real server through a Python gRPC client).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
cd build
ctest --output-on-failure -j "$(nproc)" "$@"
