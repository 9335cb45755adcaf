#!/usr/bin/env python3
"""What prefix caching buys, measured: each workload runs against a server
with --prefix_caching=true and one with --prefix_caching=false (same flags
otherwise, one server at a time), and the script prints both and their ratio.

  shared prefix   a 1,024-token system prompt with 64-token unique suffixes,
                  one stream: median time to first token (off / on)
  conversations   8-turn conversations (64-token messages, 64-token answers),
                  4 streams: generated tokens/s (on / off)
  no reuse        random 128-token prompts, 8 streams: generated tokens/s
                  (on / off), the median of alternating repeats: the cost of
                  the bookkeeping. A 300 MiB KV cache that the warm-up
                  requests go through once, so that both servers run in
                  their steady state (with caching on, new requests evict
                  cached blocks; a fresh pool would instead show the first
                  touch of its pages, once per block).

Run after tools/build.sh:
    python3 tools/bench/prefix_cache.py [--model synthetic:110m] [--repeats 3]
Prints a table and, with --json FILE, writes every run's report.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(REPO, "build", "bin")

WORKLOADS = {
    "shared prefix": ["--shared_prefix_tokens=1024", "--prompt_tokens=64", "--max_new_tokens=16",
                      "--concurrency=1", "--requests=12", "--warmup_requests=1"],
    "conversations": ["--turns=8", "--prompt_tokens=64", "--max_new_tokens=64",
                      "--concurrency=4", "--requests=64", "--warmup_requests=0"],
    "no reuse": ["--prompt_tokens=128", "--max_new_tokens=64", "--concurrency=8",
                 "--requests=48", "--warmup_requests=40"],
}
SERVER_FLAGS = {"no reuse": ["--kv_cache_memory=300MiB"]}


class Server:
    def __init__(self, model, caching, port, flags=()):
        self.port = port
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "coalesce-server"), "--model=" + model, "--host=127.0.0.1",
             "--port=%d" % port, "--metrics_port=-1", "--max_batch_size=16",
             "--prefix_caching=%s" % ("true" if caching else "false")] + list(flags),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while subprocess.run([os.path.join(BIN, "coalesce-cli"), "--server=127.0.0.1:%d" % port,
                              "--info"], capture_output=True).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start: %s" % self.proc.stderr.read())
            time.sleep(0.2)

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def bench(port, flags, seed):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [os.path.join(BIN, "coalesce-bench"), "--server=127.0.0.1:%d" % port,
               "--progress=false", "--format=none", "--json=" + f.name, "--seed=%d" % seed] + flags
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit("coalesce-bench failed (%s):\n%s%s" % (" ".join(cmd), r.stdout,
                                                                   r.stderr))
        with open(f.name) as fh:
            return json.load(fh)


def summary(report):
    return {
        "ttft_p50_s": report["latency_s"]["ttft"]["p50"],
        "generated_tokens_per_s": report["throughput"]["generated_tokens_per_s"],
        "requests_per_s": report["throughput"]["requests_per_s"],
        "prompt_tokens": report["tokens"]["prompt"],
        "cached_prompt_tokens": report["tokens"]["cached_prompt"],
        "completed": report["counts"]["completed"],
        "failed": report["counts"]["failed"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:110m")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of 'no reuse'")
    ap.add_argument("--port", type=int, default=50097)
    ap.add_argument("--json", help="write every run's summary here")
    ap.add_argument("--only", choices=sorted(WORKLOADS), help="run this workload alone")
    args = ap.parse_args()

    workloads = {n: f for n, f in WORKLOADS.items() if args.only in (None, n)}
    runs = {name: {True: [], False: []} for name in workloads}
    for name, flags in workloads.items():
        repeats = args.repeats if name == "no reuse" else 1
        for i in range(repeats):
            for caching in (True, False) if i % 2 == 0 else (False, True):
                server = Server(args.model, caching, args.port, SERVER_FLAGS.get(name, ()))
                try:
                    s = summary(bench(args.port, flags, seed=1 + i))
                finally:
                    server.close()
                if s["failed"]:
                    raise SystemExit("%s: %d requests failed" % (name, s["failed"]))
                runs[name][caching].append(s)
                print("%-14s caching %-3s  TTFT p50 %7.3f s  %7.1f generated tok/s  "
                      "%6d of %6d prompt tokens cached"
                      % (name, "on" if caching else "off", s["ttft_p50_s"],
                         s["generated_tokens_per_s"], s["cached_prompt_tokens"],
                         s["prompt_tokens"]), flush=True)

    def med(name, caching, key):
        return statistics.median(r[key] for r in runs[name][caching])

    print()
    print("model %s, server flags --max_batch_size=16; coalesce-bench %s" % (
        args.model, "; ".join("%s: %s%s" % (n, " ".join(f), "".join(
            "; server " + x for x in SERVER_FLAGS.get(n, ()))) for n, f in workloads.items())))
    print("%-40s %10s %10s %8s" % ("", "on", "off", "ratio"))
    rows = [
        ("shared prefix: median TTFT (s)", "shared prefix", "ttft_p50_s", True),
        ("conversations: generated tokens/s", "conversations", "generated_tokens_per_s", False),
        ("no reuse: generated tokens/s", "no reuse", "generated_tokens_per_s", False),
    ]
    result = {}
    for label, name, key, lower_is_better in rows:
        if name not in runs:
            continue
        on, off = med(name, True, key), med(name, False, key)
        ratio = off / on if lower_is_better else on / off
        result[name] = {"on": on, "off": off, "ratio": ratio}
        print("%-40s %10.3f %10.3f %7.2fx" % (label, on, off, ratio))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": {n: {str(k): v for k, v in r.items()} for n, r in runs.items()},
                       "result": result}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
