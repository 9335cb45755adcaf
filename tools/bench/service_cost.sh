#!/usr/bin/env bash
# The service's own cost, measured as a user would see it, in one run of a
# few minutes (after tools/build.sh):
#
#  (a) The ceiling of the gRPC and streaming path: coalesce-server with the
#      null backend (--device=null: no arithmetic, meaningless output) under
#      coalesce-bench with 256 closed-loop streams. Tokens/s streamed, and the
#      messages/s that carried them: the engine outruns the network, so each
#      stream's outbox sends several tokens per message.
#  (b) The server against its own engine, synthetic:15m on the CPU at 64
#      streams: coalesce-engine-bench decoding a batch of 64 over the context
#      range the requests cover (positions 16 to 255), without gRPC, before
#      and after the server run (their mean is the engine's rate, so that a
#      change in the machine's load during the run weighs on both sides); and
#      the server under coalesce-bench --concurrency=64 with 16-token prompts
#      and 241 new tokens (the first comes with the prefill, 240 decode steps
#      follow). The server's rate is its token counter
#      (coalesce_generated_tokens_total, which equals what the client
#      receives: see bench_smoke) over the window in which all 64 streams are
#      in flight. The client's own figure is shown beside it: with requests of
#      about 10 s, its measured time also covers the ramp after its warm-up
#      (warm-up requests, not counted, still running) and the drain at the
#      end (fewer and fewer streams), so it is lower.
#
# Usage: tools/bench/service_cost.sh [BUILD_DIR]
#   BUILD_DIR: the build folder (default $COALESCE_BUILD_DIR, else build); its
#   bin/ must hold coalesce-server, coalesce-bench and coalesce-engine-bench.
#   SERVICE_COST_SECONDS (default 30): the measured time of each server run.
#   SERVICE_COST_ENGINE_REPEAT (default 2): passes of each engine benchmark
#   over its 240 decode steps.
#   SERVICE_COST_SERVER_FLAGS: more coalesce-server flags for both runs
#   (e.g. --overlap_steps=false).
#   SERVICE_COST_DEVICE (default cpu) and SERVICE_COST_MODEL (default
#   synthetic:15m): the engine of (b). With cuda, the engine's own rate comes
#   from coalesce-loop-bench instead (the engine loop without gRPC over the
#   CUDA backend, 64 requests of the same lengths, --overlap_steps on as in
#   the server, no host work per update; the median of SERVICE_COST_ENGINE_REPEAT
#   rounds), and BUILD_DIR/bin must hold it: the GPU check runs this script on
#   tools/gpu/prepare.sh's .gpucheck/server.
# Exit status: 0 when every measurement ran and no request failed (a missed
# target is printed, not an error: numbers on a shared machine vary), 1
# otherwise.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
# The build folder as given (relative to the caller's directory), shown
# relative to the repository when inside it.
build=$(realpath -m --relative-base="$repo" "${1:-${COALESCE_BUILD_DIR:-$repo/build}}")
cd "$repo"
bin=$build/bin
secs=${SERVICE_COST_SECONDS:-30}
repeat=${SERVICE_COST_ENGINE_REPEAT:-2}
warmup=5
if ! [[ $secs =~ ^[0-9]+$ && $secs -ge 5 && $repeat =~ ^[0-9]+$ && $repeat -ge 1 ]]; then
  echo "service_cost: SERVICE_COST_SECONDS must be a whole number >= 5 and" \
    "SERVICE_COST_ENGINE_REPEAT >= 1" >&2
  exit 1
fi
model=${SERVICE_COST_MODEL:-synthetic:15m}
device=${SERVICE_COST_DEVICE:-cpu}
case $device in
  cpu) engine_bench=coalesce-engine-bench ;;
  cuda) engine_bench=coalesce-loop-bench ;;
  *)
    echo "service_cost: SERVICE_COST_DEVICE must be cpu or cuda" >&2
    exit 1
    ;;
esac
for b in coalesce-server coalesce-bench $engine_bench; do
  if [[ ! -x $bin/$b ]]; then
    echo "service_cost: $bin/$b not found; run tools/build.sh or pass the build folder" >&2
    exit 1
  fi
done

work=$(mktemp -d)
server_pid=
cleanup() {
  if [[ -n $server_pid ]]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# Small helpers in Python (standard library only): the server's ports from
# its log, its token counter, and the client's JSON report.
cat >"$work/helpers.py" <<'EOF'
import json, re, sys, time, urllib.request

def serving(log):
    """Waits for the server's 'serving' line; prints 'GRPC_PORT METRICS_PORT'."""
    pattern = re.compile(r"serving \S+ on [0-9.]+:(\d+) \(metrics port (-?\d+)\)")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(log, errors="replace") as f:
            m = pattern.search(f.read())
        if m:
            print(m.group(1), m.group(2))
            return
        time.sleep(0.1)
    sys.exit("the server did not start within 120 s; its log:\n" + open(log).read())

def counter(port):
    """Prints 'MONOTONIC_SECONDS TOKENS' from coalesce_generated_tokens_total."""
    with urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=10) as f:
        text = f.read().decode()
    m = re.search(r"^coalesce_generated_tokens_total (\S+)$", text, re.M)
    print("%.6f %d" % (time.monotonic(), float(m.group(1))))

def window(start_file, end_file):
    """Tokens/s between two counter samples."""
    t0, c0 = map(float, open(start_file).read().split())
    t1, c1 = map(float, open(end_file).read().split())
    print("%.1f %d %.2f" % ((c1 - c0) / (t1 - t0), c1 - c0, t1 - t0))

def report(path):
    """Prints 'TOKENS_PER_S MESSAGES_PER_S TOKENS_PER_MESSAGE FAILED COMPLETED ELAPSED DRAIN'."""
    r = json.load(open(path))
    measured = [x for x in r["requests"] if not x["warmup"]]
    messages = sum(x["messages"] for x in measured)
    tokens = sum(x["tokens"] for x in measured)
    elapsed = r["time"]["elapsed_s"]
    print("%.1f %.1f %.2f %d %d %.2f %.2f" % (
        r["throughput"]["generated_tokens_per_s"], messages / elapsed if elapsed else 0,
        tokens / messages if messages else 0, r["counts"]["failed"], r["counts"]["completed"],
        elapsed, r["time"].get("drain_s", 0)))

globals()[sys.argv[1]](*sys.argv[2:])
EOF
py() { python3 "$work/helpers.py" "$@"; }

# Starts coalesce-server with the given flags on free ports; sets grpc and
# metrics (ports) and server_pid.
start_server() {
  "$bin/coalesce-server" "$@" --host=127.0.0.1 --port=0 --metrics_port=0 \
    >"$work/server.log" 2>&1 &
  server_pid=$!
  read -r grpc metrics < <(py serving "$work/server.log")
}

stop_server() {
  kill "$server_pid"
  wait "$server_pid" || true
  server_pid=
}

load() { cut -d' ' -f1-3 /proc/loadavg; }

status=0
echo "# service_cost: the server's own cost ($bin, $(nproc) cores, load average $(load) at the start)"

# ---- (a) the ceiling -------------------------------------------------------
a_server="--device=null --model=synthetic:15m --max_batch_size=256 --max_batch_tokens=16384 --batch_window=0${SERVICE_COST_SERVER_FLAGS:+ $SERVICE_COST_SERVER_FLAGS}"
a_client="--concurrency=256 --duration=${secs}s --warmup=${warmup}s --prompt_tokens=16 --max_new_tokens=512"
echo
echo "## (a) ceiling: no arithmetic (--device=null), 256 closed-loop streams"
# shellcheck disable=SC2086
start_server $a_server
# shellcheck disable=SC2086
"$bin/coalesce-bench" --server=127.0.0.1:$grpc $a_client --progress=false --format=none \
  --per_request --json="$work/a.json" || status=1
stop_server
read -r a_tps a_mps a_tpm a_failed a_completed a_elapsed _ < <(py report "$work/a.json")
[[ $a_failed == 0 ]] || status=1
printf '%s tokens/s streamed in %s messages/s (%s tokens per message); %s requests, %s failed, over %s s\n' \
  "$a_tps" "$a_mps" "$a_tpm" "$a_completed" "$a_failed" "$a_elapsed"

# ---- (b) server against engine --------------------------------------------
if [[ $device == cpu ]]; then
  b_engine="--model=$model --batch_sizes=64 --context=16 --steps=240 --repeat=$repeat --sample"
else
  b_engine="--device=cuda --model=$model --batch=64 --prompt=16 --tokens=241 --deliver_us=0 --rounds=$repeat"
fi
b_server="--device=$device --model=$model --max_batch_size=64${SERVICE_COST_SERVER_FLAGS:+ $SERVICE_COST_SERVER_FLAGS}"
b_client="--concurrency=64 --duration=${secs}s --warmup=${warmup}s --prompt_tokens=16 --max_new_tokens=241"
echo
echo "## (b) server against engine: $model on $device, 64 streams, positions 16 to 255"
# Prints the engine's table; sets engine_tps (tokens/s at batch 64).
engine_run() {
  # shellcheck disable=SC2086
  "$bin/$engine_bench" $b_engine >"$work/engine.txt"
  sed 's/^/engine: /' "$work/engine.txt"
  if [[ $device == cpu ]]; then
    engine_tps=$(awk '$1 == 64 { print $3 }' "$work/engine.txt")
  else  # the median of the "overlap on" column of coalesce-loop-bench's rounds
    engine_tps=$(awk -F'|' '$2 ~ /^ *[0-9]+ *$/ { print $4 + 0 }' "$work/engine.txt" | sort -g |
      awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
  fi
}
engine_run
b_engine_before=$engine_tps
# shellcheck disable=SC2086
start_server $b_server
# shellcheck disable=SC2086
"$bin/coalesce-bench" --server=127.0.0.1:$grpc $b_client --progress=false --format=none \
  --per_request --json="$work/b.json" &
bench_pid=$!
# Every stream is in flight from the start until the sending stops at
# warm-up + duration: sample the counter within that, a second inside each end.
sleep $((warmup + 1))
py counter "$metrics" >"$work/c0"
sleep $((secs - 2))
py counter "$metrics" >"$work/c1"
wait $bench_pid || status=1
stop_server
engine_run
b_engine_after=$engine_tps
b_engine_tps=$(awk -v a="$b_engine_before" -v b="$b_engine_after" 'BEGIN { printf "%.1f", (a + b) / 2 }')
read -r b_server_tps b_window_tokens b_window_s < <(py window "$work/c0" "$work/c1")
read -r b_client_tps _ _ b_failed b_completed b_elapsed b_drain < <(py report "$work/b.json")
[[ $b_failed == 0 ]] || status=1
printf 'server: %s tokens/s over %s s with all 64 streams in flight (%s tokens); %s requests, %s failed\n' \
  "$b_server_tps" "$b_window_s" "$b_window_tokens" "$b_completed" "$b_failed"
# A request lasts about 10 s here, so the client's figure is lower: its
# measured time starts at the end of the warm-up, while warm-up requests still
# run, and ends after the drain, while fewer and fewer streams run.
printf 'client: %s tokens/s over its %s s (which include the ramp from its warm-up and a %s s drain)\n' \
  "$b_client_tps" "$b_elapsed" "$b_drain"

# ---- summary ---------------------------------------------------------------
verdict() { awk -v v="$1" -v t="$2" 'BEGIN { print (v >= t ? "met" : "MISSED") }'; }
ratio=$(awk -v s="$b_server_tps" -v e="$b_engine_tps" 'BEGIN { printf "%.1f", 100 * s / e }')
echo
echo "## summary (load average $(load) at the end)"
printf '%-48s %20s %20s %s\n' "measurement" "result" "target" ""
printf '%-48s %20s %20s %s\n' "(a) null backend, 256 streams: tokens/s" "$a_tps" ">= 50000" \
  "$(verdict "$a_tps" 50000)"
printf '%-48s %20s %20s\n' "(a) messages/s carrying them" "$a_mps" ""
printf '%-48s %20s %20s\n' "(b) engine alone, batch 64: tokens/s" "$b_engine_tps" \
  "(mean of $b_engine_before, $b_engine_after)"
printf '%-48s %20s %20s\n' "(b) server, 64 streams: tokens/s" "$b_server_tps" ""
printf '%-48s %19s%% %19s%% %s\n' "(b) server / engine" "$ratio" ">= 90" "$(verdict "$ratio" 90)"
echo
echo "commands:"
echo "  (a) $bin/coalesce-server $a_server"
echo "      $bin/coalesce-bench $a_client"
echo "  (b) $bin/$engine_bench $b_engine"
echo "      $bin/coalesce-server $b_server"
echo "      $bin/coalesce-bench $b_client"
exit $status
