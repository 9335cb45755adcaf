"""Running the points: a coalesce-server per setting (on the harness of
tools/harness/coalesce_harness.py), coalesce-bench against it, the server's
/metrics before and after; the three sections' loops."""

import json
import os
import re
import shlex
import subprocess
import sys
import time

from . import REPO, log
from .grids import STATIC_MODES, kv_cache_flag, length_label

sys.path.insert(0, os.path.join(REPO, "tools", "harness"))
from coalesce_harness import ServerProcess  # noqa: E402


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


class Runner:
    def __init__(self, args, raw_dir):
        self.server_bin = args.server_bin
        self.bench_bin = args.bench_bin
        # Per point: coalesce-bench's JSON and the server's log.
        self.raw_dir = raw_dir
        os.makedirs(self.raw_dir, exist_ok=True)
        self.failures = []

    def start(self, name, flags):
        """A server with `flags`, serving and healthy; its log in the raw folder."""
        return ServerProcess(self.server_bin, ["--grace_period=5s"] + list(flags),
                             log_path=os.path.join(self.raw_dir, name + ".server.log"),
                             start_timeout_s=120, wait_health=True)

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


def current_default_window(server_bin):
    """The --batch_window default as the server binary reports it (absl's
    --helpfull: 'default: 5ms'), so the document follows the code."""
    r = subprocess.run([server_bin, "--helpfull"], capture_output=True, text=True, timeout=30)
    text = r.stdout + r.stderr
    m = re.search(r"--batch_window \(.*?\);\s+default: ([^;\s]+);", text, re.S)
    return m.group(1) if m else None
