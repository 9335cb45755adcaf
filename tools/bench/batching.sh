#!/usr/bin/env bash
# Prints the batching trade on this machine: the engine alone at growing batch
# sizes, then the whole server (gRPC streaming included) at the same
# concurrency. Run after tools/build.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-synthetic:15m}
bin=build/bin

echo "## engine alone ($model)"
"$bin/coalesce-engine-bench" --model="$model" --batch_sizes=1,4,16,64

echo
echo "## server, 128 tokens per request ($model, --max_batch_size=64)"
port=50093
"$bin/coalesce-server" --model="$model" --max_batch_size=64 --host=127.0.0.1 \
  --port=$port --metrics_port=-1 2>/dev/null &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  "$bin/coalesce-cli" --server=127.0.0.1:$port --info >/dev/null 2>&1 && break
  sleep 0.1
done
for c in 1 4 16 64; do
  printf "concurrency %3d: " "$c"
  "$bin/coalesce-cli" --server=127.0.0.1:$port --max_new_tokens=128 --concurrency="$c" --summary \
    --prompt="Once upon a time" 2>&1 | tail -1
done
