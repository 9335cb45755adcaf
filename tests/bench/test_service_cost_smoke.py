"""Smoke test of the server on the null backend (--device=null), the one
tools/bench/service_cost.sh measures the server's own cost with: a short
closed-loop coalesce-bench run must end with no error, every generation must
run to its max_new_tokens (the null backend never emits the tokenizer's EOS,
here stories260K's, which a random id of its 512 would hit every few hundred
tokens), and the log and GetModelInfo must say that the output is
meaningless. No throughput is asserted: timed assertions flake on a shared
machine. Also checks that the script parses."""

import json
import os
import subprocess
import sys
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "service"))
from e2e_support import REPO, Server, parse_metrics, wait_for  # noqa: E402

BENCH = os.environ.get("COALESCE_BENCH") or os.path.join(REPO, "build", "bin", "coalesce-bench")
SCRIPT = os.path.join(REPO, "tools", "bench", "service_cost.sh")


@pytest.fixture(scope="module")
def server():
    if not os.path.exists(BENCH):
        pytest.fail("bench binary not found: %s (set COALESCE_BENCH)" % BENCH)
    s = Server(["--device=null", "--max_batch_size=64", "--batch_window=0"])
    yield s
    s.kill()


def generated_total(server):
    url = "http://127.0.0.1:%d/metrics" % server.metrics_port
    with urllib.request.urlopen(url, timeout=10) as f:
        return parse_metrics(f.read().decode("utf-8")).get("coalesce_generated_tokens_total")


def test_log_says_no_arithmetic(server):
    log = server.log()
    assert "backend: null (NO ARITHMETIC" in log, log
    assert "output is meaningless" in log, log


def test_closed_loop_runs_every_generation_to_its_length(server, tmp_path):
    before = generated_total(server)
    out = tmp_path / "null.json"
    cmd = [BENCH, "--server=" + server.address, "--concurrency=32", "--duration=2s",
           "--warmup=0.5s", "--prompt_tokens=4:32", "--max_new_tokens=100:300", "--per_request",
           "--format=none", "--progress=false", "--json=%s" % out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, "%s\nexit %d\nstderr:\n%s" % (" ".join(cmd), r.returncode, r.stderr)
    report = json.loads(out.read_text())
    assert report["model"]["backend"] == "null", report["model"]
    c = report["counts"]
    assert c["completed"] > 0 and c["failed"] == 0 and c["in_flight_at_end"] == 0, c
    assert c["by_status"] == {"OK": c["completed"]}, c
    # Never EOS: every request of the run, warm-up included, got all its tokens.
    assert c["finish_reasons"] == {"LENGTH": c["completed"]}, c
    records = report["requests"]
    for rec in records:
        assert rec["status"] == "OK", rec
        assert rec["tokens"] == rec["max_new_tokens"] == rec["usage_completion_tokens"], rec
    # Every token the server generated arrived.
    expected = sum(rec["tokens"] for rec in records)
    wait_for(lambda: generated_total(server) - before == expected, 5)
    assert generated_total(server) - before == expected


def test_script_parses():
    r = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_script_refuses_an_unknown_device():
    env = dict(os.environ, SERVICE_COST_DEVICE="tpu")
    r = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 1 and "SERVICE_COST_DEVICE must be cpu or cuda" in r.stderr, r
