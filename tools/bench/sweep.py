#!/usr/bin/python3
"""Sweeps coalesce's batching settings and writes the evidence: JSON, PNG plots
and, with --write-docs, docs/benchmarks.md.

Three sections, each a grid of points. A point starts coalesce-server with its
settings (free ports, waits for the health service), drives it with
coalesce-bench (JSON report), reads the server's /metrics before and after, and
stops the server:

  trade   the batching trade: closed loop at concurrency 1, 2, 4, ... per
          model; generated tokens/s and p50 inter-token latency.
  static  iteration-level (--batching=continuous) against static batching,
          output lengths uniform over a range: throughput and median
          end-to-end latency.
  window  --batch_window from 0 up, open loop (Poisson) at a moderate rate:
          time to first token and throughput.

Usage (after tools/build.sh, or any build with coalesce-server and
coalesce-bench):

  tools/bench/sweep.py                     # full grid, about 15 minutes on 2 cores
  tools/bench/sweep.py --quick             # tiny grid, 1-2 minutes
  tools/bench/sweep.py --write-docs        # full grid, then docs/benchmarks.md
  tools/bench/sweep.py --build=build-x --out=/tmp/sweep

Every statement in the generated document is computed from the data, so a
rerun keeps it true; the document is never edited by hand.

Debian's python3 with python3-matplotlib (tools/install-deps.sh); no PyPI.
"""

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---------------------------------------------------------------------------
# Grids
# ---------------------------------------------------------------------------

# Each section: what is varied, what is held, and how long each point measures.
# Durations are coalesce-bench durations ("3s"); every point also pays for the
# server start (a second or two) and the drain at the end of its measurement.
#
# The trade measures in rounds, not seconds: with every request the same
# length, a closed loop of c streams runs in lock step, so c warm-up requests
# (--warmup_requests) and then rounds x c measured ones (--requests, at least
# min_requests) keep the batch full from the first measured send to the end.
# A duration would not: at high concurrency one request outlasts a few seconds,
# so a warm-up by time would hold every stream and leave nothing measured.
GRIDS = {
    # About 15 minutes on a 2-core machine.
    "full": {
        "trade": {
            # synthetic:110m at concurrency 256 is the longest point, about
            # two minutes (three rounds of 64 steps of about half a second).
            "models": {"synthetic:15m": [1, 2, 4, 8, 16, 32, 64, 128, 256],
                       "synthetic:110m": [1, 2, 4, 8, 16, 32, 64, 128, 256]},
            "max_batch_size": 256,
            "batch_window": "0",
            "prompt_tokens": "32",
            "max_new_tokens": "64",
            "rounds": 2,
            "min_requests": 8,
        },
        "static": {
            "model": "synthetic:15m",
            # Closed loop at concurrency = the batch size.
            "max_batch_sizes": [8, 16],
            "batch_window": "5ms",
            "prompt_tokens": "32",
            # Uniform, then log-uniform (short outputs common, long ones rare).
            "lengths": ["16:512", "16:512:log"],
            "warmup": "5s",
            "duration": "30s",
        },
        "window": {
            "model": "synthetic:15m",
            "max_batch_size": 16,
            "windows_ms": [0, 1, 2, 5, 10, 20, 50],
            "load": 0.5,  # the open-loop rate, as a fraction of the measured capacity
            "prompt_tokens": "32",
            "max_new_tokens": "64",
            "calibration": "5s",
            "warmup": "2s",
            "duration": "12s",
        },
    },
    # About 1-2 minutes: the same shape, fewer and shorter points.
    "quick": {
        "trade": {
            "models": {"synthetic:15m": [1, 4, 16]},
            "max_batch_size": 256,
            "batch_window": "0",
            "prompt_tokens": "32",
            "max_new_tokens": "32",
            "rounds": 2,
            "min_requests": 4,
        },
        "static": {
            "model": "synthetic:15m",
            "max_batch_sizes": [8],
            "batch_window": "5ms",
            "prompt_tokens": "16",
            "lengths": ["16:128", "16:128:log"],
            "warmup": "1s",
            "duration": "6s",
        },
        "window": {
            "model": "synthetic:15m",
            "max_batch_size": 16,
            "windows_ms": [0, 5, 20],
            "load": 0.5,
            "prompt_tokens": "32",
            "max_new_tokens": "32",
            "calibration": "2s",
            "warmup": "1s",
            "duration": "4s",
        },
    },
    # Seconds: one or two points per section on the smallest model, for the
    # test (tests/bench/test_sweep.py). The numbers mean nothing.
    "smoke": {
        "trade": {
            "models": {"synthetic:tiny": [1, 2, 4]},
            "max_batch_size": 16,
            "batch_window": "0",
            "prompt_tokens": "8",
            "max_new_tokens": "8",
            "rounds": 2,
            "min_requests": 4,
        },
        "static": {
            "model": "synthetic:tiny",
            "max_batch_sizes": [4],
            "batch_window": "1ms",
            "prompt_tokens": "8",
            "lengths": ["4:16", "4:16:log"],
            "warmup": "0.2s",
            "duration": "0.6s",
        },
        "window": {
            "model": "synthetic:tiny",
            "max_batch_size": 8,
            "windows_ms": [0, 5],
            "load": 0.5,
            "prompt_tokens": "8",
            "max_new_tokens": "8",
            "calibration": "0.5s",
            "warmup": "0.2s",
            "duration": "0.6s",
        },
    },
}

SECTIONS = ("trade", "static", "window")

# The rule that picks the --batch_window the data supports (window section):
# among the windows whose throughput is within WINDOW_THROUGHPUT_TOLERANCE of
# the best and whose p50 time to first token is at most WINDOW_TTFT_BUDGET_MS
# above window 0's, the smallest. A window is a cost paid in every request's
# first token, so it must buy throughput to be worth it; when window 0 is
# already within the tolerance of the best, the rule picks 0.
WINDOW_THROUGHPUT_TOLERANCE = 0.05
WINDOW_TTFT_BUDGET_MS = 10.0

# The target for iteration-level against static batching.
STATIC_TARGET_RATIO = 2.0
# --batching modes of the static section: iteration-level, then the two
# static baselines (docs/batching.md).
STATIC_MODES = ("continuous", "static_padded", "static")
STATIC_LABELS = {"continuous": "iteration-level (continuous)",
                 "static_padded": "static, padded (classic)",
                 "static": "static, finished rows dropped"}

# KV bytes per token position of each synthetic model in fp32:
# 2 (K and V) x layers x KV dim x 4 bytes (docs/engines.md, "The embedded synthetic
# models"). Used to size --kv_cache_memory to what a grid point needs instead
# of the CPU default (max_batch_size full-context sequences, up to a quarter
# of RAM, which at --max_batch_size=256 is gigabytes).
KV_BYTES_PER_TOKEN = {
    "synthetic:tiny": 2 * 5 * 32 * 4,
    "synthetic:15m": 2 * 6 * 288 * 4,
    "synthetic:110m": 2 * 12 * 768 * 4,
    "synthetic:1b": 2 * 22 * 256 * 4,
}
KV_BLOCK = 16


def _upper(int_range):
    """'16:512' -> 512, '32' -> 32."""
    return int(str(int_range).split(":")[-1])


def kv_cache_flag(model, max_batch_size, prompt_tokens, max_new_tokens):
    """--kv_cache_memory holding max_batch_size sequences of the longest
    request, plus a quarter for the block rounding and preempted requests."""
    per_token = KV_BYTES_PER_TOKEN.get(model)
    if per_token is None:
        return []
    positions = _upper(prompt_tokens) + _upper(max_new_tokens)
    blocks = max_batch_size * (-(-positions // KV_BLOCK)) * 5 // 4 + 4
    mib = -(-blocks * KV_BLOCK * per_token // (1 << 20))
    return ["--kv_cache_memory=%dMiB" % max(mib, 1)]


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------

_SERVING_RE = re.compile(r"serving (\S+) on ([0-9.]+):(\d+) \(metrics port (-?\d+)\)")


def _die_with_parent(argv):
    """`argv` run so that the child gets SIGKILL if the sweep dies (e.g. killed by a
    ctest timeout): util-linux's setpriv sets PR_SET_PDEATHSIG and execs it.
    Not a preexec_fn: Python code between fork and exec in a process with
    threads (gRPC's, the log readers) can crash or deadlock the child."""
    setpriv = shutil.which("setpriv")
    return ([setpriv, "--pdeathsig=KILL", "--"] if setpriv else []) + list(argv)


def health_serving(address, timeout_s=2.0):
    """True when grpc.health.v1.Health/Check for the whole server answers
    SERVING. Raw bytes, so no stubs are needed: the request (service "") is
    empty and SERVING is field 1 = 1, encoded 08 01."""
    try:
        import grpc
    except ImportError:
        return True  # no grpcio: coalesce-bench's --wait_for_server waits instead
    try:
        with grpc.insecure_channel(address) as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            return check(b"", timeout=timeout_s) == b"\x08\x01"
    except grpc.RpcError:
        return False


class Server:
    """One coalesce-server on free ports (--port=0, --metrics_port=0: the
    server picks them and logs them), its log in a file."""

    def __init__(self, binary, flags, log_path, start_timeout_s=120):
        self.cmd = [binary, "--host=127.0.0.1", "--port=0", "--metrics_port=0",
                    "--grace_period=5s"] + list(flags)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(_die_with_parent(self.cmd), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout_s
        self.port = self.metrics_port = None
        while self.port is None:
            if self.proc.poll() is not None:
                raise RuntimeError("coalesce-server exited with %d before serving: %s\n%s"
                                   % (self.proc.returncode, shlex.join(self.cmd), self.log()))
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("coalesce-server did not serve within %d s: %s\n%s"
                                   % (start_timeout_s, shlex.join(self.cmd), self.log()))
            m = _SERVING_RE.search(self.log())
            if m:
                self.port, self.metrics_port = int(m.group(3)), int(m.group(4))
            else:
                time.sleep(0.05)
        self.address = "127.0.0.1:%d" % self.port
        while not health_serving(self.address):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("coalesce-server never reported SERVING: %s\n%s"
                                   % (shlex.join(self.cmd), self.log()))
            time.sleep(0.1)

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def metrics(self):
        """The Prometheus text, summed over label sets: {name: value}, with
        name{labels} kept too for the few labelled series we read."""
        url = "http://127.0.0.1:%d/metrics" % self.metrics_port
        try:
            with urllib.request.urlopen(url, timeout=10) as f:
                text = f.read().decode("utf-8")
        except OSError as e:
            rc = self.proc.poll()
            raise RuntimeError("cannot read %s (%s); coalesce-server %s: %s\n%s" % (
                url, e, "is running" if rc is None else "exited with %d" % rc,
                shlex.join(self.cmd), self.log())) from None
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            try:
                v = float(value)
            except ValueError:
                continue
            out[key] = out.get(key, 0.0) + v
            base = key.split("{", 1)[0]
            if base != key:
                out[base] = out.get(base, 0.0) + v
        return out

    def stop(self):
        """SIGTERM (the server drains in --grace_period; nothing runs by now),
        SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def metric_deltas(before, after):
    """What the server did during one bench run (warm-up included), from the
    counters and histograms of /metrics."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("coalesce_batch_size_count", 0.0)
    step_s = d.get("coalesce_engine_step_seconds_sum", 0.0)
    generated = d.get("coalesce_generated_tokens_total", 0.0)
    admitted = d.get("coalesce_window_wait_seconds_count", 0.0)
    return {
        "engine_steps": int(steps),
        "mean_batch_size": d.get("coalesce_batch_size_sum", 0.0) / steps if steps else 0.0,
        "engine_busy_s": step_s,
        # Tokens per second of engine time: what the engine makes of its work,
        # whatever the offered load (at a light load the client's tokens/s is
        # just the arrival rate).
        "tokens_per_engine_s": generated / step_s if step_s else 0.0,
        "generated_tokens": int(generated),
        "mean_window_wait_ms": (1e3 * d.get("coalesce_window_wait_seconds_sum", 0.0) / admitted
                                if admitted else 0.0),
        "preemptions": int(d.get("coalesce_preemptions_total", 0.0)),
    }


# ---------------------------------------------------------------------------
# One point
# ---------------------------------------------------------------------------

def _seconds(duration):
    """'5s' / '500ms' -> seconds."""
    m = re.fullmatch(r"([0-9.]+)(ms|s)", duration)
    if not m:
        raise ValueError("duration %r: use N s or N ms" % duration)
    return float(m.group(1)) / (1e3 if m.group(2) == "ms" else 1)


class Runner:
    def __init__(self, args, raw_dir):
        self.server_bin = args.server_bin
        self.bench_bin = args.bench_bin
        # Per point: coalesce-bench's JSON and the server's log.
        self.raw_dir = raw_dir
        os.makedirs(self.raw_dir, exist_ok=True)
        self.failures = []

    def start(self, name, flags):
        return Server(self.server_bin, flags, os.path.join(self.raw_dir, name + ".server.log"))

    def bench(self, server, name, bench_flags):
        """Runs coalesce-bench against `server`; returns the point's record."""
        json_path = os.path.join(self.raw_dir, name + ".json")
        cmd = [self.bench_bin, "--server=" + server.address, "--format=none",
               "--progress=false", "--wait_for_server=30s", "--seed=1",
               "--json=" + json_path] + list(bench_flags)
        before = server.metrics()
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wall = time.monotonic() - t0
        after = server.metrics()
        if r.returncode not in (0, 1) or not os.path.exists(json_path):
            raise RuntimeError("coalesce-bench failed (exit %d): %s\n%s" %
                               (r.returncode, shlex.join(cmd), r.stderr[-4000:]))
        with open(json_path) as f:
            report = json.load(f)
        if report["counts"]["failed"]:
            self.failures.append("%s: %d failed requests %s" % (
                name, report["counts"]["failed"], report.get("errors")))
        lat = report["latency_s"]
        summary = {
            "tokens_per_s": report["throughput"]["generated_tokens_per_s"],
            "requests_per_s": report["throughput"]["requests_per_s"],
            "completed": report["counts"]["completed"],
            "failed": report["counts"]["failed"],
            "itl_p50_ms": 1e3 * lat["itl"]["p50"],
            "tpot_p50_ms": 1e3 * lat["tpot"]["p50"],
            "ttft_p50_ms": 1e3 * lat["ttft"]["p50"],
            "ttft_p99_ms": 1e3 * lat["ttft"]["p99"],
            "e2e_p50_s": lat["e2e"]["p50"],
            "e2e_p99_s": lat["e2e"]["p99"],
            "tokens_per_request": (report["tokens"]["generated"] / report["counts"]["sent"]
                                   if report["counts"]["sent"] else 0.0),
            "wall_s": wall,
        }
        return {
            "name": name,
            "server_cmd": shlex.join(_portable(server.cmd)),
            "bench_cmd": shlex.join(_portable(cmd)),
            "summary": summary,
            "server": metric_deltas(before, after),
            "report": report,
        }


def _portable(cmd):
    """A command as a reader reruns it: binaries relative to the repository,
    the sweep's own output paths shortened."""
    out = []
    for a in cmd:
        if os.path.isabs(a) and a.startswith(REPO + os.sep):
            a = os.path.relpath(a, REPO)
        a = re.sub(r"^--json=.*/", "--json=", a)
        a = re.sub(r"^--server=127\.0\.0\.1:\d+$", "--server=127.0.0.1:PORT", a)
        out.append(a)
    return out


def log(msg):
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------

def run_trade(runner, g):
    points = []
    for model, concurrencies in g["models"].items():
        flags = ["--model=" + model, "--max_batch_size=%d" % g["max_batch_size"],
                 "--batch_window=" + g["batch_window"]]
        flags += kv_cache_flag(model, g["max_batch_size"], g["prompt_tokens"],
                               g["max_new_tokens"])
        tag = model.replace("synthetic:", "")
        server = runner.start("trade-" + tag, flags)
        try:
            for c in concurrencies:
                name = "trade-%s-c%d" % (tag, c)
                p = runner.bench(server, name, [
                    "--concurrency=%d" % c, "--warmup_requests=%d" % c,
                    "--requests=%d" % max(g["rounds"] * c, g["min_requests"]),
                    "--prompt_tokens=" + g["prompt_tokens"],
                    "--max_new_tokens=" + g["max_new_tokens"]])
                p["params"] = {"model": model, "concurrency": c}
                points.append(p)
                s = p["summary"]
                log("trade %s c=%d: %.1f tokens/s, itl p50 %.2f ms, mean batch %.1f (%.1f s)" % (
                    model, c, s["tokens_per_s"], s["itl_p50_ms"], p["server"]["mean_batch_size"],
                    s["wall_s"]))
        finally:
            server.stop()
    return points


def length_label(lengths):
    """'16:512' -> 'uniform 16:512', '16:512:log' -> 'log-uniform 16:512'."""
    return ("log-uniform " + lengths[:-4]) if lengths.endswith(":log") else ("uniform " + lengths)


def run_static(runner, g):
    points = []
    for size in g["max_batch_sizes"]:
        for mode in STATIC_MODES:
            flags = ["--model=" + g["model"], "--max_batch_size=%d" % size,
                     "--batch_window=" + g["batch_window"], "--batching=" + mode]
            server = runner.start("static-%s-b%d" % (mode, size), flags)
            try:
                for lengths in g["lengths"]:
                    name = "static-%s-b%d-%s" % (
                        mode, size, "log" if lengths.endswith(":log") else "uniform")
                    p = runner.bench(server, name, [
                        "--concurrency=%d" % size, "--warmup=" + g["warmup"],
                        "--duration=" + g["duration"], "--prompt_tokens=" + g["prompt_tokens"],
                        "--max_new_tokens=" + lengths, "--per_request"])
                    steady_state_throughput(p)
                    p["params"] = {"batching": mode, "max_batch_size": size, "concurrency": size,
                                   "lengths": lengths}
                    points.append(p)
                    s = p["summary"]
                    log("static %s batch %d %s: %.1f tokens/s (%.1f with the drain), e2e p50 "
                        "%.2f s (%.1f s)" % (mode, size, length_label(lengths), s["tokens_per_s"],
                                             s["tokens_per_s_with_drain"], s["e2e_p50_s"],
                                             s["wall_s"]))
            finally:
                server.stop()
    return points


def steady_state_throughput(point):
    """Replaces the point's tokens/s by the steady state's: the tokens of the
    requests (warm-up ones included) that ended while requests were still being
    sent, over that time. Mixed lengths make the drain at the end long (up to
    the longest request, at a shrinking batch), and static batching's drain
    differs from continuous batching's, so coalesce-bench's tokens/s, whose
    time includes the drain, would compare the drains as much as the modes.
    The per-request records are dropped afterwards: the summary keeps what
    they gave."""
    report = point["report"]
    t0, t1 = report["time"]["measured_start_s"], report["time"]["sending_end_s"]
    records = report.pop("requests")
    tokens = sum(r["tokens"] for r in records
                 if r["status"] == "OK" and t0 <= r["send_s"] + r["e2e_s"] <= t1)
    s = point["summary"]
    s["tokens_per_s_with_drain"] = s["tokens_per_s"]
    s["tokens_per_s"] = tokens / (t1 - t0) if t1 > t0 else 0.0
    s["steady_state_s"] = t1 - t0


def run_window(runner, g, rate=None):
    """Returns (points, calibration). Without `rate`, the rate is g['load']
    times the capacity measured on the first window's server: closed loop at
    concurrency max_batch_size, requests/s."""
    points = []
    calibration = None
    for i, w in enumerate(g["windows_ms"]):
        flags = ["--model=" + g["model"], "--max_batch_size=%d" % g["max_batch_size"],
                 "--batch_window=%gms" % w]
        server = runner.start("window-%gms" % w, flags)
        try:
            if i == 0 and rate is None:
                calibration = runner.bench(server, "window-calibration", [
                    "--concurrency=%d" % g["max_batch_size"], "--warmup=1s",
                    "--duration=" + g["calibration"], "--prompt_tokens=" + g["prompt_tokens"],
                    "--max_new_tokens=" + g["max_new_tokens"]])
                capacity = calibration["summary"]["requests_per_s"]
                rate = round(g["load"] * capacity, 2)
                calibration["params"] = {"capacity_requests_per_s": capacity,
                                         "load": g["load"], "rate": rate}
                log("window: capacity %.2f requests/s at concurrency %d; rate %.2f/s" % (
                    capacity, g["max_batch_size"], rate))
            name = "window-%gms" % w
            p = runner.bench(server, name, [
                "--rate=%g" % rate, "--warmup=" + g["warmup"], "--duration=" + g["duration"],
                "--prompt_tokens=" + g["prompt_tokens"],
                "--max_new_tokens=" + g["max_new_tokens"]])
            p["params"] = {"batch_window_ms": w, "rate": rate}
            points.append(p)
            s = p["summary"]
            log("window %g ms: ttft p50 %.1f ms p99 %.1f ms, %.1f tokens/s, mean batch %.1f" % (
                w, s["ttft_p50_ms"], s["ttft_p99_ms"], s["tokens_per_s"],
                p["server"]["mean_batch_size"]))
        finally:
            server.stop()
    return points, calibration


# ---------------------------------------------------------------------------
# Analysis: the statements of the document, computed from the data
# ---------------------------------------------------------------------------

def analyze_trade(points):
    out = {}
    for model in dict.fromkeys(p["params"]["model"] for p in points):
        rows = sorted((p for p in points if p["params"]["model"] == model),
                      key=lambda p: p["params"]["concurrency"])
        first = rows[0]["summary"]
        peak = max(rows, key=lambda p: p["summary"]["tokens_per_s"])
        # The knee: the smallest concurrency reaching 90% of the peak.
        knee = next(p for p in rows
                    if p["summary"]["tokens_per_s"] >= 0.9 * peak["summary"]["tokens_per_s"])
        out[model] = {
            "c_first": rows[0]["params"]["concurrency"],
            "tps_first": first["tokens_per_s"],
            "itl_first_ms": first["itl_p50_ms"],
            "c_peak": peak["params"]["concurrency"],
            "tps_peak": peak["summary"]["tokens_per_s"],
            "itl_peak_ms": peak["summary"]["itl_p50_ms"],
            "c_knee": knee["params"]["concurrency"],
            "tps_knee": knee["summary"]["tokens_per_s"],
            "itl_knee_ms": knee["summary"]["itl_p50_ms"],
            "c_last": rows[-1]["params"]["concurrency"],
            "tps_last": rows[-1]["summary"]["tokens_per_s"],
            "itl_last_ms": rows[-1]["summary"]["itl_p50_ms"],
        }
    return out


def analyze_static(points):
    out = []
    settings = sorted({(p["params"]["max_batch_size"], p["params"]["lengths"]) for p in points})
    for size, lengths in settings:
        by = {p["params"]["batching"]: p for p in points
              if (p["params"]["max_batch_size"], p["params"]["lengths"]) == (size, lengths)}
        if "continuous" not in by:
            continue
        it = by["continuous"]["summary"]
        for baseline in ("static_padded", "static"):
            if baseline not in by:
                continue
            st = by[baseline]["summary"]
            ratio = it["tokens_per_s"] / st["tokens_per_s"] if st["tokens_per_s"] else float("inf")
            out.append({
                "max_batch_size": size,
                "lengths": lengths,
                "baseline": baseline,
                "ratio": ratio,
                "tps_iteration": it["tokens_per_s"],
                "tps_static": st["tokens_per_s"],
                "e2e_p50_iteration_s": it["e2e_p50_s"],
                "e2e_p50_static_s": st["e2e_p50_s"],
                "latency_no_worse": it["e2e_p50_s"] <= st["e2e_p50_s"],
                # Sequences per engine step (server; padding rows not counted),
                # the occupancy static batching loses.
                "batch_iteration": by["continuous"]["server"]["mean_batch_size"],
                "batch_static": by[baseline]["server"]["mean_batch_size"],
                "target_met": ratio >= STATIC_TARGET_RATIO and it["e2e_p50_s"] <= st["e2e_p50_s"],
            })
    return out


def analyze_window(points):
    rows = sorted(points, key=lambda p: p["params"]["batch_window_ms"])
    best = max(p["summary"]["tokens_per_s"] for p in rows)
    base = next((p for p in rows if p["params"]["batch_window_ms"] == 0), rows[0])
    ttft0 = base["summary"]["ttft_p50_ms"]
    eligible = [p for p in rows
                if p["summary"]["tokens_per_s"] >= (1 - WINDOW_THROUGHPUT_TOLERANCE) * best
                and p["summary"]["ttft_p50_ms"] <= ttft0 + WINDOW_TTFT_BUDGET_MS]
    return {
        "best_tokens_per_s": best,
        "base_window_ms": base["params"]["batch_window_ms"],
        "ttft0_p50_ms": ttft0,
        "eligible_ms": [p["params"]["batch_window_ms"] for p in eligible],
        "supported_ms": eligible[0]["params"]["batch_window_ms"] if eligible else None,
    }


def current_default_window(server_bin):
    """The --batch_window default as the server binary reports it (absl's
    --helpfull: 'default: 5ms'), so the document follows the code."""
    r = subprocess.run([server_bin, "--helpfull"], capture_output=True, text=True, timeout=30)
    text = r.stdout + r.stderr
    m = re.search(r"--batch_window \(.*?\);\s+default: ([^;\s]+);", text, re.S)
    return m.group(1) if m else None


def duration_ms(text):
    """'5ms' -> 5, '0' -> 0, '1.5s' -> 1500, '500us' -> 0.5; None if unknown."""
    if text is None:
        return None
    if text == "0":
        return 0.0
    total, found = 0.0, False
    for num, unit in re.findall(r"([0-9.]+)(ns|us|ms|s|m|h)", text):
        total += float(num) * {"ns": 1e-6, "us": 1e-3, "ms": 1, "s": 1e3, "m": 6e4,
                               "h": 3.6e6}[unit]
        found = True
    return total if found else None


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------

def plot_all(results, img_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    sec = results["sections"]
    if sec.get("trade"):
        pts = sec["trade"]["points"]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
        for model in dict.fromkeys(p["params"]["model"] for p in pts):
            rows = sorted((p for p in pts if p["params"]["model"] == model),
                          key=lambda p: p["params"]["concurrency"])
            c = [p["params"]["concurrency"] for p in rows]
            tps = [p["summary"]["tokens_per_s"] for p in rows]
            itl = [p["summary"]["itl_p50_ms"] for p in rows]
            axes[0].plot(c, tps, "o-", label=model)
            axes[1].plot(c, itl, "o-", label=model)
            axes[2].plot(itl, tps, "o-", label=model)
            for x, y, n in zip(itl, tps, c):
                axes[2].annotate(str(n), (x, y), textcoords="offset points", xytext=(4, -10),
                                 fontsize=7)
        for ax in axes[:2]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (closed loop)")
        axes[0].set_ylabel("generated tokens/s")
        axes[0].set_title("throughput")
        axes[1].set_ylabel("inter-token latency p50 (ms)")
        # Log scales need positive values: on a model so fast that tokens share
        # messages, the p50 gap can be 0 (tools/bench/report.h).
        positive = all(p["summary"]["itl_p50_ms"] > 0 for p in pts)
        if positive:
            axes[1].set_yscale("log")
        axes[1].set_title("per-token latency")
        if positive:
            axes[2].set_xscale("log")
        axes[2].set_xlabel("inter-token latency p50 (ms)")
        axes[2].set_ylabel("generated tokens/s")
        axes[2].set_title("the trade (labels: concurrency)")
        for ax in axes:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files["trade"] = _save(fig, img_dir, "batching_trade.png")

    if sec.get("static"):
        pts = sec["static"]["points"]
        settings = sorted({(p["params"]["max_batch_size"], p["params"]["lengths"]) for p in pts})
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        width = 0.27
        for i, mode in enumerate(STATIC_MODES):
            by = {(p["params"]["max_batch_size"], p["params"]["lengths"]): p["summary"]
                  for p in pts if p["params"]["batching"] == mode}
            if not by:
                continue
            xs = [j + (i - 1) * width for j in range(len(settings))]
            label = STATIC_LABELS[mode]
            axes[0].bar(xs, [by[k]["tokens_per_s"] for k in settings], width, label=label)
            axes[1].bar(xs, [by[k]["e2e_p50_s"] for k in settings], width, label=label)
        for ax in axes:
            ax.set_xticks(range(len(settings)))
            ax.set_xticklabels(["batch %d\n%s" % (b, length_label(l)) for b, l in settings],
                               fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        axes[0].set_ylabel("generated tokens/s")
        axes[0].set_title("throughput")
        axes[1].set_ylabel("end-to-end latency p50 (s)")
        axes[1].set_title("median latency")
        fig.tight_layout()
        files["static"] = _save(fig, img_dir, "static_vs_iteration.png")

    if sec.get("window"):
        rows = sorted(sec["window"]["points"], key=lambda p: p["params"]["batch_window_ms"])
        w = [p["params"]["batch_window_ms"] for p in rows]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        axes[0].plot(w, [p["summary"]["ttft_p50_ms"] for p in rows], "o-", label="p50")
        axes[0].plot(w, [p["summary"]["ttft_p99_ms"] for p in rows], "s--", label="p99")
        axes[0].set_ylabel("time to first token (ms)")
        axes[0].set_title("time to first token")
        axes[1].plot(w, [p["summary"]["tokens_per_s"] for p in rows], "o-",
                     label="client: generated tokens/s")
        axes[1].plot(w, [p["server"]["tokens_per_engine_s"] for p in rows], "s--",
                     label="server: tokens per engine-busy second")
        axes[1].set_ylabel("tokens/s")
        axes[1].set_title("throughput")
        axes[1].set_ylim(bottom=0)
        for ax in axes:
            ax.set_xscale("symlog", linthresh=1)
            ax.margins(x=0.06)
            ax.set_xlabel("--batch_window (ms)")
            ax.set_xticks(w)
            ax.set_xticklabels(["%g" % x for x in w])
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files["window"] = _save(fig, img_dir, "window.png")
    plt.close("all")
    return files


def _save(fig, img_dir, name):
    os.makedirs(img_dir, exist_ok=True)
    path = os.path.join(img_dir, name)
    fig.savefig(path, dpi=100)
    return path


# ---------------------------------------------------------------------------
# The document
# ---------------------------------------------------------------------------

def _f(x, digits=1):
    return "%.*f" % (digits, x)


def _ratio(a, b):
    return a / b if b else float("inf")


def _commands_block(points):
    lines = []
    seen = set()
    for p in points:
        if p["server_cmd"] not in seen:
            seen.add(p["server_cmd"])
            lines.append(p["server_cmd"] + " &")
        lines.append(p["bench_cmd"])
    return ("<details><summary>commands</summary>\n\n```sh\n" + "\n".join(lines) +
            "\n```\n\n</details>\n")


def write_docs(results, doc_path, img_files):
    meta = results["meta"]
    sec = results["sections"]
    doc_dir = os.path.dirname(os.path.abspath(doc_path))

    def img(key, alt):
        return "![%s](%s)\n" % (alt, os.path.relpath(img_files[key], doc_dir))

    L = []
    L.append("# Benchmarks: batching settings\n")
    L.append("Generated by `tools/bench/sweep.py --write-docs`; do not edit by hand. Rerun it to "
             "refresh every number, table, plot and statement below: the statements are computed "
             "from the data.\n")
    L.append("| | |\n| --- | --- |")
    L.append("| command | `%s` |" % meta["command"])
    L.append("| grid | `%s` |" % meta["grid"])
    L.append("| commit | `%s`%s |" % (meta["commit"], " (with uncommitted changes)"
                                       if meta["dirty"] else ""))
    L.append("| date | %s |" % meta["date"])
    L.append("| machine | %s, %s CPUs, %s memory, %s |" % (
        meta["cpu_model"], meta["cpus"], meta["memory"], meta["os"]))
    L.append("| load average | %s before, %s after |" % (meta["load_before"], meta["load_after"]))
    L.append("| duration | %.1f minutes |" % (meta["elapsed_s"] / 60))
    L.append("| data | `%s` (every point: commands, the full coalesce-bench report, server "
             "metrics) |\n" % os.path.relpath(os.path.join(REPO, meta["results_json"]), doc_dir))
    L.append("Every point starts its own `coalesce-server` on free ports (`--port=0 "
             "--metrics_port=0`), waits for the health service to say `SERVING`, runs "
             "`coalesce-bench`, and stops the server. The server and the load generator share "
             "the machine's CPUs, as they do in docs/performance.md's measurements; a point of a "
             "few seconds on a shared machine varies by about 10% from run to run. "
             "Throughput is generated tokens over the measured time (which includes the drain "
             "at the end); latencies are coalesce-bench's (`tools/bench/report.h`).\n")

    if sec.get("trade"):
        g = sec["trade"]["grid"]
        a = sec["trade"]["analysis"]
        pts = sec["trade"]["points"]
        L.append("## The batching trade\n")
        L.append("Closed loop (`--concurrency=N` streams always in flight), prompts of %s tokens, "
                 "%s new tokens per request, `--max_batch_size=%d --batch_window=%s`. All "
                 "requests have the same length, so the N streams run in lock step: each point "
                 "sends N warm-up requests, then %d x N measured ones (at least %d), and the "
                 "batch stays full from the first measured send to the end.\n" % (
                     g["prompt_tokens"], g["max_new_tokens"], g["max_batch_size"],
                     g["batch_window"], g["rounds"], g["min_requests"]))
        for model, s in a.items():
            text = ("**%s**: from concurrency %d to %d, generated tokens/s go from %s to %s "
                    "(%.1fx) while the p50 inter-token latency goes from %s ms to %s ms "
                    "(%.1fx). " % (
                        model, s["c_first"], s["c_last"], _f(s["tps_first"]), _f(s["tps_last"]),
                        _ratio(s["tps_last"], s["tps_first"]), _f(s["itl_first_ms"], 2),
                        _f(s["itl_last_ms"], 2), _ratio(s["itl_last_ms"], s["itl_first_ms"])))
            if s["c_knee"] == s["c_last"]:
                text += ("Throughput still rises at the largest concurrency measured: no "
                         "smaller concurrency reaches 90%% of its %s tokens/s, so this grid "
                         "ends before the knee." % _f(s["tps_last"]))
            else:
                text += ("The peak is %s tokens/s at concurrency %d (%.1fx concurrency %d); "
                         "90%% of it is reached at concurrency %d, at %s ms per token. Beyond "
                         "that, more concurrency buys at most 11%% more throughput (the peak over "
                         "90%% of it) for more latency per token (%.1fx by concurrency %d)." % (
                             _f(s["tps_peak"]), s["c_peak"],
                             _ratio(s["tps_peak"], s["tps_first"]), s["c_first"], s["c_knee"],
                             _f(s["itl_knee_ms"], 2),
                             _ratio(s["itl_last_ms"], s["itl_knee_ms"]), s["c_last"]))
                if s["tps_last"] < 0.95 * s["tps_peak"]:
                    text += (" Past the peak, throughput falls, to %s tokens/s at concurrency "
                             "%d." % (_f(s["tps_last"]), s["c_last"]))
            L.append(text + "\n")
        L.append(img("trade", "throughput and inter-token latency against concurrency"))
        L.append("| model | concurrency | tokens/s | requests/s | ITL p50 ms | TPOT p50 ms | "
                 "TTFT p50 ms | e2e p50 s | mean batch (server) | failed |")
        L.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for p in pts:
            s, v = p["summary"], p["server"]
            L.append("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %d |" % (
                p["params"]["model"], p["params"]["concurrency"], _f(s["tokens_per_s"]),
                _f(s["requests_per_s"], 2), _f(s["itl_p50_ms"], 2), _f(s["tpot_p50_ms"], 2),
                _f(s["ttft_p50_ms"], 1), _f(s["e2e_p50_s"], 3), _f(v["mean_batch_size"]),
                s["failed"]))
        L.append("")
        L.append(_commands_block(pts))

    if sec.get("static"):
        g = sec["static"]["grid"]
        a = sec["static"]["analysis"]
        pts = sec["static"]["points"]
        L.append("## Iteration-level against static batching\n")
        L.append("`--batching=continuous` (sequences join and leave at every step) against two "
                 "static baselines, in which a batch runs until its longest sequence ends: "
                 "`--batching=static_padded`, the classic fixed-shape batch, whose finished "
                 "sequences keep their rows (recomputed as padding) and KV blocks until then, and "
                 "`--batching=static`, which drops finished rows from the steps, a stronger "
                 "baseline than servers without iteration-level scheduling offer. %s, "
                 "`--max_batch_size` %s with `--batch_window=%s`, closed loop at concurrency = "
                 "the batch size, prompts of %s tokens and output lengths (`--max_new_tokens`) "
                 "%s; %s warm-up and %s measured per point. "
                 "A log-uniform length makes every doubling equally likely (16-31, 32-63, ..., "
                 "256-511 tokens a fifth each), so short outputs are common and long ones rare, "
                 "the skew of real chat traffic; a static batch then waits longer, relative to "
                 "its mean, for its longest member. "
                 "The issue's target: at least %gx the throughput at no worse median end-to-end "
                 "latency. Throughput here is the steady state's: tokens of the requests that "
                 "ended while requests were still being sent, over that time (the drain at the "
                 "end, up to one longest request at a shrinking batch, is left out; the table "
                 "shows coalesce-bench's figure with it too).\n" % (
                     g["model"], " and ".join(str(b) for b in g["max_batch_sizes"]),
                     g["batch_window"], g["prompt_tokens"],
                     " and ".join("%s tokens (`%s`)" % (length_label(l), l) for l in g["lengths"]),
                     g["warmup"], g["duration"], STATIC_TARGET_RATIO))
        for s in a:
            L.append(
                "Batch %d, output lengths %s, against %s: iteration-level gives **%.2fx** the "
                "throughput "
                "(%s against %s tokens/s) at median end-to-end latency %s s against %s s: the "
                "target is **%s**%s. The static batches served %s sequences per engine step on "
                "average (padding rows not counted), iteration-level %s (of %d slots).\n" % (
                    s["max_batch_size"], length_label(s["lengths"]),
                    "padded static" if s["baseline"] == "static_padded" else "static without padding",
                    s["ratio"],
                    _f(s["tps_iteration"]), _f(s["tps_static"]),
                    _f(s["e2e_p50_iteration_s"], 3), _f(s["e2e_p50_static_s"], 3),
                    "met" if s["target_met"] else "not met",
                    "" if s["target_met"] else (
                        " (throughput %s %gx, median latency %s)" % (
                            "reaches" if s["ratio"] >= STATIC_TARGET_RATIO else "below",
                            STATIC_TARGET_RATIO,
                            "no worse" if s["latency_no_worse"] else "worse")),
                    _f(s["batch_static"]), _f(s["batch_iteration"]), s["max_batch_size"]))
        # Why the ratio depends on the batch size: how much this engine gains
        # from a fuller batch, from the batching trade measured above.
        trade = {p["params"]["concurrency"]: p["summary"]["tokens_per_s"]
                 for p in (sec.get("trade") or {}).get("points", [])
                 if p["params"]["model"] == g["model"]}
        sizes = g["max_batch_sizes"]
        halves = [(b // 2, b) for b in sizes if b // 2 in trade and b in trade]
        if halves and a:
            fuller = [s["batch_iteration"] / s["batch_static"] for s in a if s["batch_static"]]
            L.append(
                "Continuous batching kept the batch %.1fx to %.1fx as full as static here (the "
                "mean batches above). Against padded static batches, whose steps always carry "
                "every row, that occupancy is about the throughput ratio. Against static batches "
                "without padding it is worth as much only while a step costs the same however "
                "many sequences share it. "
                "The batching trade above measures what a fuller batch buys "
                "this engine: %s. A step reads every weight once whatever the batch, but its "
                "arithmetic grows with the batch, and on this machine's cores it soon takes "
                "longer than the read: from there a step costs more the more sequences it "
                "carries, and a fuller batch buys less.\n" % (min(fuller), max(fuller), "; ".join(
                    "concurrency %d gives %.2fx the tokens/s of concurrency %d" % (
                        b, trade[b] / trade[h], h) for h, b in halves)))
        L.append(img("static", "iteration-level against static batching"))
        L.append("| batch | output lengths | batching | tokens/s | tokens/s with the drain | "
                 "e2e p50 s | e2e p99 s | TTFT p50 ms | tokens per request | mean batch (server) "
                 "| failed |")
        L.append("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for p in pts:
            s, v = p["summary"], p["server"]
            L.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d |" % (
                p["params"]["max_batch_size"], length_label(p["params"]["lengths"]),
                p["params"]["batching"], _f(s["tokens_per_s"]),
                _f(s["tokens_per_s_with_drain"]), _f(s["e2e_p50_s"], 3), _f(s["e2e_p99_s"], 3),
                _f(s["ttft_p50_ms"]), _f(s["tokens_per_request"]), _f(v["mean_batch_size"]),
                s["failed"]))
        L.append("")
        L.append(_commands_block(pts))

    if sec.get("window"):
        g = sec["window"]["grid"]
        a = sec["window"]["analysis"]
        pts = sorted(sec["window"]["points"], key=lambda p: p["params"]["batch_window_ms"])
        cal = sec["window"].get("calibration")
        rate = pts[0]["params"]["rate"]
        L.append("## The coalescing window\n")
        how = ("%g of the capacity measured first (closed loop at concurrency %d with window "
               "%g ms: %s requests/s)" % (g["load"], g["max_batch_size"], pts[0]["params"][
                   "batch_window_ms"], _f(cal["params"]["capacity_requests_per_s"], 2))
               if cal else "given with `--window_rate`")
        L.append("Open loop: Poisson arrivals at %s requests/s (%s), the same arrival schedule "
                 "(`--seed=1`) at every window; %s, `--max_batch_size=%d`, prompts of %s tokens, "
                 "%s new tokens; %s warm-up and %s measured per point. The server's columns come "
                 "from its `/metrics` over the run (warm-up included): sequences per engine step, "
                 "the time the window held each admitted request, and generated tokens per "
                 "second of engine time.\n" % (_f(rate, 2), how, g["model"], g["max_batch_size"],
                                               g["prompt_tokens"], g["max_new_tokens"],
                                               g["warmup"], g["duration"]))
        first, last = pts[0], pts[-1]
        L.append(
            "From window %g ms to %g ms, the p50 time to first token goes from %s ms to %s ms "
            "and the p99 from %s ms to %s ms; throughput goes from %s to %s tokens/s, the mean "
            "batch from %s to %s sequences per step, and the engine's tokens per busy second "
            "from %s to %s.\n" % (
                first["params"]["batch_window_ms"], last["params"]["batch_window_ms"],
                _f(first["summary"]["ttft_p50_ms"]), _f(last["summary"]["ttft_p50_ms"]),
                _f(first["summary"]["ttft_p99_ms"]), _f(last["summary"]["ttft_p99_ms"]),
                _f(first["summary"]["tokens_per_s"]), _f(last["summary"]["tokens_per_s"]),
                _f(first["server"]["mean_batch_size"]), _f(last["server"]["mean_batch_size"]),
                _f(first["server"]["tokens_per_engine_s"]),
                _f(last["server"]["tokens_per_engine_s"])))
        L.append(
            "**Which default the data supports.** Rule: among the windows whose throughput is "
            "within %d%% of the best (%s tokens/s here) and whose p50 time to first token is at "
            "most %g ms above window %g ms's (%s ms), the smallest; a window costs every "
            "request latency, so it must buy throughput to be chosen. Eligible here: %s. " % (
                round(100 * WINDOW_THROUGHPUT_TOLERANCE), _f(a["best_tokens_per_s"]),
                WINDOW_TTFT_BUDGET_MS, a["base_window_ms"], _f(a["ttft0_p50_ms"]),
                ", ".join("%g ms" % w for w in a["eligible_ms"]) or "none"))
        cur = a.get("current_default")
        cur_ms = duration_ms(cur)
        if a["supported_ms"] is None:
            verdict = ("No window meets the rule: the windows that reach the throughput cost "
                       "more than %g ms of median time to first token." % WINDOW_TTFT_BUDGET_MS)
        else:
            verdict = "The data supports `--batch_window=%gms`." % a["supported_ms"]
        if cur is None:
            verdict += " (The server's current default could not be read from `--helpfull`.)"
        elif a["supported_ms"] is not None and cur_ms is not None and \
                abs(cur_ms - a["supported_ms"]) < 1e-9:
            verdict += " The current default, `--batch_window=%s`, agrees." % cur
        else:
            in_grid = [p for p in pts if cur_ms is not None and
                       abs(p["params"]["batch_window_ms"] - cur_ms) < 1e-9]
            detail = ""
            if in_grid:
                s = in_grid[0]["summary"]
                detail = (" (at %s: %s tokens/s, p50 time to first token %s ms against %s ms "
                          "at %g ms)" % (cur, _f(s["tokens_per_s"]), _f(s["ttft_p50_ms"]),
                                         _f(a["ttft0_p50_ms"]), a["base_window_ms"]))
            verdict += (" The current default, `--batch_window=%s`, is %s by this data%s." % (
                cur, "eligible but not the smallest, so not supported"
                if cur_ms in a["eligible_ms"] else "not supported", detail))
        L.append(verdict + " This holds for this machine, model and load; on another, rerun "
                 "the sweep.\n")
        L.append(img("window", "time to first token and throughput against the window"))
        L.append("| --batch_window | TTFT p50 ms | TTFT p99 ms | tokens/s | e2e p50 s | "
                 "mean batch (server) | window wait ms (server) | tokens per engine-s | "
                 "failed |")
        L.append("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for p in pts:
            s, v = p["summary"], p["server"]
            L.append("| %g ms | %s | %s | %s | %s | %s | %s | %s | %d |" % (
                p["params"]["batch_window_ms"], _f(s["ttft_p50_ms"]), _f(s["ttft_p99_ms"]),
                _f(s["tokens_per_s"]), _f(s["e2e_p50_s"], 3), _f(v["mean_batch_size"], 2),
                _f(v["mean_window_wait_ms"], 2), _f(v["tokens_per_engine_s"]), s["failed"]))
        L.append("")
        L.append(_commands_block(([cal] if cal else []) + pts))

    if results.get("failures"):
        L.append("## Failed requests\n")
        for f in results["failures"]:
            L.append("* " + f)
        L.append("")
    with open(doc_path, "w") as f:
        f.write("\n".join(L).rstrip() + "\n")


# ---------------------------------------------------------------------------
# Machine and provenance
# ---------------------------------------------------------------------------

def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                              cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info():
    cpu_model, cpus = "unknown CPU", str(os.cpu_count())
    for line in _run(["lscpu"]).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            cpu_model = value.strip()
        elif key.strip() == "CPU(s)":
            cpus = value.strip()
    memory = "unknown"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory = "%.1f GiB" % (int(line.split()[1]) / (1 << 20))
    except OSError:
        pass
    os_name = "unknown OS"
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    os_name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {"cpu_model": cpu_model, "cpus": cpus, "memory": memory, "os": os_name}


def load_average():
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(REPO, "build"),
                   help="build folder holding bin/coalesce-server and bin/coalesce-bench")
    p.add_argument("--server_bin", help="coalesce-server (default: BUILD/bin/coalesce-server)")
    p.add_argument("--bench_bin", help="coalesce-bench (default: BUILD/bin/coalesce-bench)")
    p.add_argument("--grid", choices=sorted(GRIDS), default="full")
    p.add_argument("--quick", action="store_const", const="quick", dest="grid",
                   help="the tiny grid (about 1-2 minutes): --grid=quick")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated subset of %s" % ",".join(SECTIONS))
    p.add_argument("--window_rate", type=float,
                   help="open-loop rate of the window section, requests/s (default: the "
                        "grid's load fraction of a capacity measured first)")
    p.add_argument("--out", help="folder for results.json, raw/ and the plots (default: "
                                 "BUILD/sweep, or docs/benchmarks with --write-docs)")
    p.add_argument("--from_results", metavar="RESULTS_JSON",
                   help="run nothing: redo the analysis, plots and document from a previous "
                        "results.json (e.g. after changing how the document is written)")
    p.add_argument("--write-docs", nargs="?", const=os.path.join(REPO, "docs", "benchmarks.md"),
                   dest="write_docs", metavar="PATH",
                   help="also write the document (default docs/benchmarks.md); its plots and "
                        "data go beside it, in benchmarks/")
    args = p.parse_args(argv)
    args.server_bin = args.server_bin or os.path.join(args.build, "bin", "coalesce-server")
    args.bench_bin = args.bench_bin or os.path.join(args.build, "bin", "coalesce-bench")
    for b in (args.server_bin, args.bench_bin) if not args.from_results else ():
        if not os.access(b, os.X_OK):
            p.error("%s not found (build first, e.g. tools/build.sh, or pass --build)" % b)
    args.sections = [s for s in args.sections.split(",") if s]
    bad = set(args.sections) - set(SECTIONS)
    if bad:
        p.error("unknown sections: %s" % ",".join(sorted(bad)))
    if args.out is None:
        if args.write_docs:
            stem = os.path.splitext(os.path.basename(args.write_docs))[0]
            args.out = os.path.join(os.path.dirname(os.path.abspath(args.write_docs)), stem)
        else:
            args.out = os.path.join(args.build, "sweep")
    return args


def redo(args):
    """--from_results: the analysis, plots and document again, from the data."""
    with open(args.from_results) as f:
        results = json.load(f)
    sec = results["sections"]
    if "trade" in sec:
        sec["trade"]["analysis"] = analyze_trade(sec["trade"]["points"])
    if "static" in sec:
        sec["static"]["analysis"] = analyze_static(sec["static"]["points"])
    if "window" in sec:
        default = sec["window"]["analysis"].get("current_default")
        sec["window"]["analysis"] = analyze_window(sec["window"]["points"])
        sec["window"]["analysis"]["current_default"] = default  # as the run's server said
    out_dir = os.path.dirname(os.path.abspath(args.from_results))
    img_files = plot_all(results, out_dir)
    results["plots"] = {k: os.path.relpath(v, out_dir) for k, v in img_files.items()}
    with open(args.from_results, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    if args.write_docs:
        write_docs(results, args.write_docs, img_files)
        log("wrote %s" % args.write_docs)
    return 0


def main(argv):
    args = parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (fail now, not after the sweep)
    except ImportError:
        sys.exit("sweep.py needs matplotlib: apt-get install python3-matplotlib "
                 "(tools/install-deps.sh), and run it with Debian's /usr/bin/python3")
    if args.from_results:
        return redo(args)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    grid = GRIDS[args.grid]
    # The raw files stay out of docs/: results.json holds every report anyway.
    raw_dir = (os.path.join(os.path.abspath(args.build), "sweep-raw") if args.write_docs
               else os.path.join(out_dir, "raw"))
    runner = Runner(args, raw_dir)
    started = time.monotonic()
    shown = ["tools/bench/sweep.py"] + [a for a in argv]
    results = {
        "meta": dict(machine_info(),
                     command=shlex.join(shown),
                     grid=args.grid,
                     commit=_run(["git", "rev-parse", "HEAD"]) or "unknown",
                     dirty=bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])),
                     date=datetime.datetime.now(datetime.timezone.utc).strftime(
                         "%Y-%m-%d %H:%M UTC"),
                     load_before=load_average(),
                     server_bin=os.path.relpath(args.server_bin, REPO),
                     bench_bin=os.path.relpath(args.bench_bin, REPO)),
        "sections": {},
    }
    log("grid %s, sections %s, output %s" % (args.grid, ",".join(args.sections), out_dir))
    if "trade" in args.sections:
        pts = run_trade(runner, grid["trade"])
        results["sections"]["trade"] = {"grid": grid["trade"], "points": pts,
                                        "analysis": analyze_trade(pts)}
    if "static" in args.sections:
        pts = run_static(runner, grid["static"])
        results["sections"]["static"] = {"grid": grid["static"], "points": pts,
                                         "analysis": analyze_static(pts)}
    if "window" in args.sections:
        pts, cal = run_window(runner, grid["window"], args.window_rate)
        analysis = analyze_window(pts)
        analysis["current_default"] = current_default_window(args.server_bin)
        results["sections"]["window"] = {"grid": grid["window"], "points": pts,
                                         "calibration": cal, "analysis": analysis}
    results["meta"]["load_after"] = load_average()
    results["meta"]["elapsed_s"] = time.monotonic() - started
    results["failures"] = runner.failures
    results_path = os.path.join(out_dir, "results.json")
    results["meta"]["results_json"] = os.path.relpath(results_path, REPO)
    img_files = plot_all(results, out_dir)
    results["plots"] = {k: os.path.relpath(v, out_dir) for k, v in img_files.items()}
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    log("wrote %s and %s" % (results_path, ", ".join(sorted(results["plots"].values()))))
    if args.write_docs:
        os.makedirs(os.path.dirname(os.path.abspath(args.write_docs)), exist_ok=True)
        write_docs(results, args.write_docs, img_files)
        log("wrote %s" % args.write_docs)
    if runner.failures:
        log("some requests failed:\n  " + "\n  ".join(runner.failures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
