#!/usr/bin/env bash
# Quick start: install, build, and serve the embedded default model on
# localhost:50051 (metrics on :9090). Extra arguments go to coalesce-server.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
exec build/bin/coalesce-server "$@"
