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

With --sweep it instead measures the shared-prefix workload at several
prefix lengths (--lengths), caching on and off, prints median time to first
token against the length, and with --plot writes it as a PNG
(python3-matplotlib); --from_json re-plots a sweep's --json without running.

Run after tools/build.sh:
    python3 tools/bench/prefix_cache.py [--model synthetic:110m] [--repeats 3]
    python3 tools/bench/prefix_cache.py --sweep --plot docs/benchmarks/prefix_cache_ttft.png
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
BIN = os.path.join(REPO, "build", "bin")  # --bin

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


def run_sweep(args):
    """Median TTFT of the shared-prefix workload at each prefix length."""
    points = []
    for length in args.lengths:
        flags = ["--shared_prefix_tokens=%d" % length, "--prompt_tokens=%d" % args.suffix_tokens,
                 "--max_new_tokens=16", "--concurrency=1", "--requests=%d" % args.requests,
                 "--warmup_requests=1"]
        point = {"shared_prefix_tokens": length}
        for caching in (True, False):
            server = Server(args.model, caching, args.port)
            try:
                s = summary(bench(args.port, flags, seed=1))
            finally:
                server.close()
            if s["failed"]:
                raise SystemExit("prefix %d: %d requests failed" % (length, s["failed"]))
            point["on" if caching else "off"] = s
            print("prefix %5d  caching %-3s  TTFT p50 %7.3f s  %6d of %6d prompt tokens cached"
                  % (length, "on" if caching else "off", s["ttft_p50_s"],
                     s["cached_prompt_tokens"], s["prompt_tokens"]), flush=True)
        points.append(point)
    return {"model": args.model, "suffix_tokens": args.suffix_tokens, "requests": args.requests,
            "points": points}


def print_sweep(sweep):
    print()
    print("model %s, --max_batch_size=16; coalesce-bench --shared_prefix_tokens=N "
          "--prompt_tokens=%d --max_new_tokens=16 --concurrency=1 --requests=%d "
          "--warmup_requests=1" % (sweep["model"], sweep["suffix_tokens"], sweep["requests"]))
    print("%-22s %12s %12s %8s" % ("shared prefix tokens", "TTFT on (s)", "TTFT off (s)", "off/on"))
    for p in sweep["points"]:
        on, off = p["on"]["ttft_p50_s"], p["off"]["ttft_p50_s"]
        print("%-22d %12.3f %12.3f %7.2fx" % (p["shared_prefix_tokens"], on, off, off / on))


def plot_sweep(sweep, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    x = [p["shared_prefix_tokens"] for p in sweep["points"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for key, label, marker in (("off", "prefix caching off", "s"),
                               ("on", "prefix caching on", "o")):
        ax.plot(x, [p[key]["ttft_p50_s"] for p in sweep["points"]], marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xticks(x)
    ax.set_xticklabels([str(v) for v in x])
    ax.set_xlabel("shared system prompt (tokens), each request adding %d of its own"
                  % sweep["suffix_tokens"])
    ax.set_ylabel("median time to first token (s)")
    ax.set_title("Prefix caching, %s, one stream" % sweep["model"])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    global BIN
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:110m")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of 'no reuse'")
    ap.add_argument("--port", type=int, default=50097)
    ap.add_argument("--json", help="write every run's summary here")
    ap.add_argument("--only", choices=sorted(WORKLOADS), help="run this workload alone")
    ap.add_argument("--bin", default=BIN, help="folder of coalesce-server, -bench and -cli")
    ap.add_argument("--sweep", action="store_true",
                    help="median TTFT against the shared prefix's length instead")
    ap.add_argument("--lengths", default="128,256,512,1024",
                    type=lambda v: [int(x) for x in v.split(",")],
                    help="--sweep: shared prefix lengths, in tokens")
    ap.add_argument("--suffix_tokens", type=int, default=64, help="--sweep: each request's own")
    ap.add_argument("--requests", type=int, default=8, help="--sweep: measured requests a point")
    ap.add_argument("--plot", help="--sweep: write the PNG here")
    ap.add_argument("--from_json", help="--sweep: re-plot this --json instead of measuring")
    args = ap.parse_args()
    BIN = args.bin

    if args.sweep:
        if args.from_json:
            with open(args.from_json) as f:
                sweep = json.load(f)
        else:
            sweep = run_sweep(args)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(sweep, f, indent=1)
        print_sweep(sweep)
        if args.plot:
            plot_sweep(sweep, args.plot)
        return 0

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
