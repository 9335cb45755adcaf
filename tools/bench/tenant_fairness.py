#!/usr/bin/env python3
"""Fairness between tenants, measured: tenant B's median time to first token
on an idle server and while tenant A floods it with ten times its share of
the batch, and the capacity A keeps.

One server with --api_keys_file: tenants a and b, weight 1 each, so each
one's share is half of --max_batch_size. Two coalesce-bench processes send
the load, each with its tenant's key (--api_key_file).

  idle        B alone: --b_streams closed-loop streams
  fair        A's flood (10 x its share in closed-loop streams, longer
              requests) and, once it has filled the batch, B as in 'idle'
  one tenant  the same, but B sends A's key: one tenant, first come first
              served (what a server without fairness does)
  A alone     A's flood alone

It prints B's median time to first token in each and its ratio to 'idle'
(the target: 'fair' / 'idle' <= 2); the mean sequences per engine step
(coalesce_batch_size) while B ran beside A's flood against A's flood alone
(work-conserving: 1, A keeps every slot B does not use), the tokens the
server generated per second, and the sequences preempted for fairness
(coalesce_tenant_preemptions_total), and the mean engine step time of steps
with prompt tokens and of decode-only steps (coalesce_engine_step_seconds):
beside the flood, B's first token waits for the step in flight and then
comes from a step that also decodes A's sequences.

Run after tools/build.sh:
    python3 tools/bench/tenant_fairness.py [--model synthetic:15m] [--duration 20]
Prints a table and, with --json FILE, writes every run's summary.
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(REPO, "build", "bin")  # --bin


class Server:
    def __init__(self, args, keys_file, log):
        self.metrics_port = args.metrics_port or args.port + 1
        self.log = log
        self.proc = subprocess.Popen(
            [os.path.join(args.bin, "coalesce-server"), "--model=" + args.model,
             "--host=127.0.0.1", "--port=%d" % args.port, "--metrics_port=%d" % self.metrics_port,
             "--max_batch_size=%d" % args.max_batch_size, "--api_keys_file=" + keys_file]
            + args.server_flag,
            stdout=subprocess.DEVNULL, stderr=log, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.counters()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise SystemExit("the server did not start: %s" % log.read())
                time.sleep(0.2)

    def metrics(self):
        url = "http://127.0.0.1:%d/metrics" % self.metrics_port
        with urllib.request.urlopen(url, timeout=10) as f:
            return f.read().decode()

    def counters(self):
        """Tokens generated and sequences run by every step so far, and the
        steps: coalesce_generated_tokens_total and coalesce_batch_size's sum
        and count."""
        text = self.metrics()

        def value(name):
            m = re.search(r"^%s (\S+)$" % name, text, re.M)
            return float(m.group(1)) if m else 0.0
        out = {"generated": value("coalesce_generated_tokens_total"),
               "sequences": value("coalesce_batch_size_sum"),
               "steps": value("coalesce_batch_size_count")}
        # Engine step time: steps with prompt tokens (phase prefill or
        # mixed), and decode-only steps.
        for kind, phases in (("prompt", ("prefill", "mixed")), ("decode", ("decode",))):
            for part in ("sum", "count"):
                out["%s_step_%s" % (kind, part)] = sum(
                    value(r'coalesce_engine_step_seconds_%s\{phase="%s"\}' % (part, phase))
                    for phase in phases)
        return out

    def tenant_first_tokens(self, tenant):
        """coalesce_tenant_time_to_first_token_seconds of the tenant: (sum, count)."""
        text = self.metrics()

        def value(part):
            m = re.search(r'^coalesce_tenant_time_to_first_token_seconds_%s\{tenant="%s"\} (\S+)$'
                          % (part, tenant), text, re.M)
            return float(m.group(1)) if m else 0.0
        return value("sum"), value("count")

    def fairness_preemptions(self):
        """coalesce_tenant_preemptions_total, summed over the tenants."""
        return sum(float(v) for v in re.findall(r"^coalesce_tenant_preemptions_total\{[^}]*\} (\S+)$",
                                                 self.metrics(), re.M))

    def tenant_statuses(self):
        """coalesce_tenant_requests_total by (tenant, status)."""
        text = self.metrics()
        out = {}
        for m in re.finditer(r'^coalesce_tenant_requests_total\{(.*)\} (\S+)$', text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[(labels.get("tenant"), labels.get("status"))] = float(m.group(2))
        return out

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def bench_cmd(args, key_file, flags, json_path, seed):
    return [os.path.join(args.bin, "coalesce-bench"), "--server=127.0.0.1:%d" % args.port,
            "--api_key_file=" + key_file, "--progress=false", "--format=none",
            "--json=" + json_path, "--seed=%d" % seed] + flags


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit("coalesce-bench failed (%s):\n%s%s" % (" ".join(cmd), r.stdout, r.stderr))


def load(path):
    with open(path) as f:
        report = json.load(f)
    c = report["counts"]
    return {"ttft_p50_s": report["latency_s"]["ttft"]["p50"],
            "ttft_mean_s": report["latency_s"]["ttft"]["mean"],
            "generated_tokens_per_s": report["throughput"]["generated_tokens_per_s"],
            "completed": c["completed"], "by_status": c["by_status"]}


def phase(args, server, tmp, name, b_tenant, with_flood, with_b):
    """Runs A's flood (in the background, until B is done) and/or B; returns
    B's summary and the server's generated tokens/s over B's window (or, with
    A alone, over --duration)."""
    b_json = os.path.join(tmp, name.replace(" ", "-") + "-b.json")
    flood_streams = 10 * args.max_batch_size // 2
    a_flags = ["--concurrency=%d" % flood_streams, "--prompt_tokens=%d" % args.prompt_tokens,
               "--max_new_tokens=%d" % args.a_max_new_tokens, "--warmup=0s", "--duration=1h"]
    b_flags = ["--concurrency=%d" % args.b_streams, "--prompt_tokens=%d" % args.prompt_tokens,
               "--max_new_tokens=%d" % args.b_max_new_tokens, "--warmup=0s",
               "--duration=%ds" % args.duration]
    flood = None
    if with_flood:
        flood = subprocess.Popen(bench_cmd(args, args.keys["a"], a_flags, os.devnull, 1),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(args.lead)  # the flood fills the batch and the queue
        if flood.poll() is not None:
            raise SystemExit("A's coalesce-bench ended early (exit %d)" % flood.returncode)
    try:
        before, start = server.counters(), time.monotonic()
        preempted = server.fairness_preemptions()
        b_first = server.tenant_first_tokens(b_tenant) if b_tenant else None
        if with_b:
            run(bench_cmd(args, args.keys[b_tenant], b_flags, b_json, 2))
        else:
            time.sleep(args.duration)
        after, elapsed = server.counters(), time.monotonic() - start
    finally:
        if flood is not None:
            flood.terminate()  # its streams end cancelled
            flood.wait(60)
    steps = after["steps"] - before["steps"]

    def delta(key):
        return after[key] - before[key]
    out = {"server_generated_tokens_per_s": (after["generated"] - before["generated"]) / elapsed,
           "mean_batch": (after["sequences"] - before["sequences"]) / steps if steps else 0.0,
           # Mean engine step time of steps with prompt tokens and of decode-only ones.
           **{"%s_step_ms" % kind: 1000 * delta(kind + "_step_sum") / delta(kind + "_step_count")
              if delta(kind + "_step_count") else 0.0 for kind in ("prompt", "decode")},
           "fairness_preemptions": server.fairness_preemptions() - preempted}
    if with_b:
        out["b"] = load(b_json)
        # The server's own measure, arrival to the step that made the
        # token: without the gRPC delivery or the client. (As one tenant,
        # B's requests are not told apart from A's.)
        first_sum, first_count = (a - b for a, b in zip(server.tenant_first_tokens(b_tenant),
                                                         b_first))
        if b_tenant == "b" and first_count:
            out["b"]["server_ttft_mean_s"] = first_sum / first_count
    return out


# name: (B's key, A floods, B sends)
PHASES = {"idle": ("b", False, True), "fair": ("b", True, True),
          "one tenant": ("a", True, True), "A alone": (None, True, False)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:15m")
    ap.add_argument("--max_batch_size", type=int, default=8)
    ap.add_argument("--duration", type=int, default=20, help="seconds B sends in each phase")
    ap.add_argument("--lead", type=int, default=3, help="seconds A's flood runs before B starts")
    ap.add_argument("--b_streams", type=int, default=1, help="B's closed-loop streams")
    ap.add_argument("--prompt_tokens", type=int, default=32)
    ap.add_argument("--a_max_new_tokens", type=int, default=128)
    ap.add_argument("--b_max_new_tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=50093)
    ap.add_argument("--metrics_port", type=int, default=0, help="default: --port + 1")
    ap.add_argument("--server_flag", action="append", default=[],
                    help="another server flag (repeatable), e.g. --server_flag=--dtype=fp32")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help="comma-separated phases to run, of: " + ", ".join(PHASES))
    ap.add_argument("--json", help="write every phase's summary here")
    ap.add_argument("--server_log", help="keep the server's log in this file")
    ap.add_argument("--bin", default=BIN, help="folder of coalesce-server and coalesce-bench")
    args = ap.parse_args()
    args.phases = args.phases.split(",")
    for name in args.phases:
        if name not in PHASES:
            ap.error("unknown phase %r" % name)
    if args.b_streams >= args.max_batch_size // 2:
        ap.error("--b_streams must stay below B's share, half of --max_batch_size")

    with tempfile.TemporaryDirectory() as tmp:
        args.keys = {}
        tenants = []
        for name in ("a", "b"):
            key = "fairness-bench-%s-%s" % (name, os.urandom(8).hex())
            args.keys[name] = os.path.join(tmp, name + ".key")
            with open(args.keys[name], "w") as f:
                f.write(key + "\n")
            tenants.append({"name": name, "weight": 1,
                            "key_sha256": hashlib.sha256(key.encode()).hexdigest()})
        keys_file = os.path.join(tmp, "tenants.json")
        with open(keys_file, "w") as f:
            json.dump({"tenants": tenants}, f)
        log = open(args.server_log or os.path.join(tmp, "server.log"), "w+")
        server = Server(args, keys_file, log)
        try:
            results = {}
            for name in args.phases:
                results[name] = phase(args, server, tmp, name, *PHASES[name])
            statuses = server.tenant_statuses()
        finally:
            server.close()

    for name, r in results.items():
        bad = {k: v for k, v in r.get("b", {}).get("by_status", {}).items() if k != "OK"}
        if bad:
            raise SystemExit("%s: B's requests failed: %s" % (name, bad))
    # A's streams end cancelled when its coalesce-bench stops; nothing else.
    bad = {k: v for k, v in statuses.items() if k[1] not in ("ok", "cancelled")}
    if bad:
        raise SystemExit("requests ended in error, by (tenant, status): %s" % bad)
    idle = results.get("idle", {}).get("b", {}).get("ttft_p50_s")
    print("model %s, --max_batch_size=%d: A floods with %d streams of %d tokens; B sends %d "
          "stream(s) of %d tokens; prompts of %d tokens; %d s a phase" % (
              args.model, args.max_batch_size, 10 * args.max_batch_size // 2,
              args.a_max_new_tokens, args.b_streams, args.b_max_new_tokens, args.prompt_tokens,
              args.duration))
    print("%-11s %13s %8s %14s %16s %15s %10s %11s %16s %15s" % (
        "phase", "B TTFT p50 ms", "vs idle", "B TTFT mean ms", "server B mean ms",
        "server tokens/s", "mean batch", "preemptions", "prompt step ms", "decode step ms"))

    def ms(b, key):
        return "%.1f" % (1000 * b[key]) if key in b else "-"
    for name, r in results.items():
        b = r.get("b", {})
        ttft = b.get("ttft_p50_s")
        print("%-11s %13s %8s %14s %16s %15.0f %10.2f %11d %16.1f %15.1f" % (
            name, ms(b, "ttft_p50_s"),
            "%.2fx" % (ttft / idle) if ttft is not None and idle else "-",
            ms(b, "ttft_mean_s"), ms(b, "server_ttft_mean_s"),
            r["server_generated_tokens_per_s"], r["mean_batch"], r["fairness_preemptions"],
            r["prompt_step_ms"], r["decode_step_ms"]))
    if idle:
        for name, target in (("fair", " (target <= 2)"), ("one tenant", "")):
            if name in results:
                print("B TTFT p50, %s / idle: %.2fx%s" % (
                    name, results[name]["b"]["ttft_p50_s"] / idle, target))
    server_idle = results.get("idle", {}).get("b", {}).get("server_ttft_mean_s")
    server_fair = results.get("fair", {}).get("b", {}).get("server_ttft_mean_s")
    if server_idle and server_fair:
        print("B TTFT mean in the server (arrival to its first token's step), fair / idle: %.2fx"
              % (server_fair / server_idle))
    if "fair" in results and "A alone" in results:
        fair, alone = results["fair"], results["A alone"]
        print("mean batch with B beside A's flood / A's flood alone: %.2f (work-conserving: 1)"
              % (fair["mean_batch"] / alone["mean_batch"]))
        print("server tokens/s with B beside A's flood / A's flood alone: %.2f" % (
            fair["server_generated_tokens_per_s"] / alone["server_generated_tokens_per_s"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "keys"},
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
