#!/usr/bin/env bash
# SmolLM2-135M-Instruct (the Quick start model, fetched once by
# tools/models/smollm2.py) on this machine: the engine alone at batch 1, 16
# and 64, with the file's Q4_1/Q8_0 matrices dequantized to float32 and kept
# in their blocks (as the server runs them), each against the floor of its
# weight bytes over the measured memory bandwidth, then the whole server (gRPC streaming included) with 1 and then 16
# concurrent streams of ChatML questions that ask for long answers
# (tools/bench/workloads/chatml-long-answers.jsonl, at most 128 tokens each).
# Run after tools/build.sh. Extra arguments go to both coalesce-bench runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=build/bin
model="$(python3 tools/models/smollm2.py build/models)"

echo "## engine alone"
"$bin/coalesce-engine-bench" --model="$model" --batch_sizes=1,16,64 --context=128 --steps=16 \
  --sample --limits --compare_quantized

port=50094
"$bin/coalesce-server" --model="$model" --max_batch_size=16 --host=127.0.0.1 --port=$port \
  --metrics_port=-1 2>/dev/null &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  "$bin/coalesce-cli" --server=127.0.0.1:$port --info >/dev/null 2>&1 && break
  sleep 0.1
done
for c in 1 16; do
  echo
  echo "## server, concurrency $c"
  "$bin/coalesce-bench" --server=127.0.0.1:$port --concurrency="$c" --max_new_tokens=128 \
    --workload=tools/bench/workloads/chatml-long-answers.jsonl --warmup=5s --duration=30s \
    --progress=false "$@"
done
