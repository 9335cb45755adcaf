"""Smoke test of coalesce-bench against a live server (synthetic:tiny): a short
closed-loop and open-loop run each, checked for consistent counts, ordered
latency percentiles, throughput that matches its own definition, and a token
count equal to the server's own (coalesce_generated_tokens_total); and a dead
address, which must give UNAVAILABLE failures and a non-zero exit status."""

import csv
import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "service"))
from e2e_support import REPO, Server, parse_metrics, wait_for  # noqa: E402

BENCH = os.environ.get("COALESCE_BENCH") or os.path.join(REPO, "build", "bin", "coalesce-bench")
BENCH_TIMEOUT = 60  # seconds; each run below takes 3 s or less


@pytest.fixture(scope="module")
def server():
    if not os.path.exists(BENCH):
        pytest.fail("bench binary not found: %s (set COALESCE_BENCH)" % BENCH)
    s = Server(model_flags=["--model=synthetic:tiny"])
    yield s
    s.kill()


def generated_total(server):
    url = "http://127.0.0.1:%d/metrics" % server.metrics_port
    with urllib.request.urlopen(url, timeout=10) as f:
        return parse_metrics(f.read().decode("utf-8")).get("coalesce_generated_tokens_total")


def run_bench(args, expect_rc=0):
    cmd = [BENCH] + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_TIMEOUT)
    assert r.returncode == expect_rc, "%s\nexit %d\nstdout:\n%s\nstderr:\n%s" % (
        " ".join(cmd), r.returncode, r.stdout, r.stderr)
    return r


def check_latency(name, s, strictly_positive=True):
    assert s["count"] > 0, (name, s)
    assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (name, s)
    assert s["min"] <= s["mean"] <= s["max"], (name, s)
    if strictly_positive:
        assert s["min"] > 0, (name, s)
    else:
        assert s["min"] >= 0 and s["max"] > 0, (name, s)


def check_report(report, duration_s):
    c = report["counts"]
    # Every measured request ended, and successfully.
    assert c["sent"] == c["completed"] + c["failed"] + c["in_flight_at_end"], c
    assert c["failed"] == 0 and c["in_flight_at_end"] == 0 and c["cancelled_at_end"] == 0, c
    assert c["completed"] > 0, c
    assert c["by_status"] == {"OK": c["completed"]}, c
    assert sum(c["finish_reasons"].values()) == c["completed"], c
    assert c["usage_mismatches"] == 0, c
    w = report["warmup"]
    assert w["sent"] == w["completed"] and w["failed"] == 0 and w["in_flight_at_end"] == 0, w

    lat = report["latency_s"]
    check_latency("ttft", lat["ttft"])
    check_latency("e2e", lat["e2e"])
    check_latency("tpot", lat["tpot"])
    # Tokens that arrive in one message are gaps of 0 (see tools/bench/report.h),
    # so small inter-token percentiles may be 0 on a fast server.
    check_latency("itl", lat["itl"], strictly_positive=False)
    assert lat["e2e"]["max"] >= lat["ttft"]["max"]
    assert lat["e2e"]["count"] == c["completed"]

    # Throughput is completions over the measured time, which is the window
    # plus the drain at the end.
    t = report["time"]
    tp = report["throughput"]
    elapsed = t["elapsed_s"]
    assert duration_s * 0.98 <= elapsed <= duration_s + 5, t
    assert tp["requests_per_s"] == pytest.approx(c["completed"] / elapsed, rel=1e-9)
    assert tp["generated_tokens_per_s"] == pytest.approx(
        report["tokens"]["generated"] / elapsed, rel=1e-9)
    assert 0 < tp["goodput_requests_per_s"] <= tp["requests_per_s"]

    records = report["requests"]
    measured = [r for r in records if not r["warmup"]]
    assert len(measured) == c["sent"] and len(records) == c["sent"] + w["sent"]
    assert sum(r["tokens"] for r in measured) == report["tokens"]["generated"]
    assert sum(r["tokens"] for r in records if r["warmup"]) == w["generated_tokens"]
    for r in records:
        assert r["status"] == "OK", r
        assert r["tokens"] == r["usage_completion_tokens"] <= r["max_new_tokens"], r
        assert 0 < r["ttft_s"] <= r["last_token_s"] <= r["e2e_s"], r
    return records


def check_server_count(server, before, report):
    """The client's token count equals the server's: every token generated
    (warm-up included) arrived, and no other load ran meanwhile."""
    expected = report["tokens"]["generated"] + report["warmup"]["generated_tokens"]
    # The engine adds a step's tokens to the counter just after sending them.
    wait_for(lambda: generated_total(server) - before == expected, 5)
    assert generated_total(server) - before == expected


def test_closed_loop(server, tmp_path):
    before = generated_total(server)
    out = tmp_path / "closed.json"
    table = tmp_path / "closed.csv"
    r = run_bench(["--server=" + server.address, "--concurrency=8", "--duration=2s",
                   "--warmup=0.5s", "--prompt_tokens=16:64", "--max_new_tokens=8:48",
                   "--per_request", "--json=%s" % out, "--csv=%s" % table])
    assert "time to first token" in r.stdout and "goodput" in r.stdout, r.stdout
    report = json.loads(out.read_text())
    assert report["config"]["mode"] == "closed" and report["config"]["concurrency"] == 8
    assert report["model"]["name"] == "synthetic:tiny"
    records = check_report(report, 2.0)
    check_server_count(server, before, report)

    # A closed loop never has more than --concurrency streams in flight.
    for r in records:
        t = r["send_s"]
        in_flight = sum(1 for o in records if o["send_s"] <= t < o["send_s"] + o["e2e_s"])
        assert in_flight <= 8, (t, in_flight)
    # Prompt lengths are exact (token ids) and within the range.
    assert all(16 <= r["prompt_tokens"] <= 64 for r in records)

    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 1
    assert int(rows[0]["sent"]) == report["counts"]["sent"]
    assert rows[0]["mode"] == "closed"
    assert float(rows[0]["ttft_p50_ms"]) == pytest.approx(
        report["latency_s"]["ttft"]["p50"] * 1e3, abs=1e-3)


def test_open_loop(server):
    before = generated_total(server)
    r = run_bench(["--server=" + server.address, "--rate=20", "--duration=2.5s", "--warmup=0s",
                   "--prompt_tokens=32", "--max_new_tokens=16", "--seed=7", "--per_request",
                   "--format=json"])
    report = json.loads(r.stdout)
    assert report["config"]["mode"] == "open" and report["config"]["rate"] == 20
    records = check_report(report, 2.5)
    check_server_count(server, before, report)
    # 50 arrivals expected; a Poisson count is within 4 standard deviations
    # (sqrt(50) ~ 7) but for once in ~30,000 runs, and the seed is fixed.
    assert 20 <= report["counts"]["sent"] <= 80, report["counts"]
    assert all(r["prompt_tokens"] == 32 for r in records)
    sends = [r["send_s"] for r in records]
    assert sends == sorted(sends) and sends[-1] < 2.5 + 0.5  # + a late send


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_server():
    address = "127.0.0.1:%d" % free_port()
    # Without the model's description the bench cannot build requests: exit 3.
    r = run_bench(["--server=" + address, "--wait_for_server=0s", "--requests=4"], expect_rc=3)
    assert "UNAVAILABLE" in r.stderr, r.stderr
    # With the vocabulary given, every request is sent and fails: exit 1.
    r = run_bench(["--server=" + address, "--vocab_size=512", "--requests=6", "--concurrency=2",
                   "--warmup=0s", "--format=json"], expect_rc=1)
    report = json.loads(r.stdout)
    c = report["counts"]
    assert c["sent"] == 6 and c["failed"] == 6 and c["completed"] == 0, c
    assert c["by_status"] == {"UNAVAILABLE": 6}, c
    assert "UNAVAILABLE" in report["errors"]
    assert report["latency_s"]["ttft"]["count"] == 0
    assert report["throughput"]["requests_per_s"] == 0
