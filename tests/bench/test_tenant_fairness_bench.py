"""tools/bench/tenant_fairness.py end to end on synthetic:tiny with short
phases: a real server with two tenants, two coalesce-bench processes with
their keys. Checks the report's shape, that no request failed, and what
fairness must have done: B's requests beside A's flood preempted some of A's
sequences, and with one tenant none; B's median time to first token beside
the flood is far below its wait behind the flood as one tenant (the two
differ by two orders of magnitude on this model, so the comparison does not
depend on the machine's speed). The 2x target is measured by the full run
(docs/performance.md), not here."""

import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "bench", "tenant_fairness.py")
SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(REPO, "build", "bin", "coalesce-server")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fairness_bench_runs_and_fairness_shows(tmp_path):
    data = tmp_path / "fairness.json"
    cmd = [sys.executable, SCRIPT, "--model=synthetic:tiny", "--max_batch_size=4",
           "--duration=2", "--lead=1", "--a_max_new_tokens=64", "--b_max_new_tokens=4",
           "--port=%d" % free_port(), "--metrics_port=%d" % free_port(),
           "--bin=" + os.path.dirname(SERVER), "--json=" + str(data)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, "%s\nexit %d\nstdout:\n%s\nstderr:\n%s" % (
        " ".join(cmd), r.returncode, r.stdout, r.stderr)
    assert "B TTFT p50, fair / idle: " in r.stdout and "(target <= 2)" in r.stdout, r.stdout
    assert "A's flood alone: " in r.stdout, r.stdout
    results = json.loads(data.read_text())["results"]
    assert list(results) == ["idle", "fair", "one tenant", "A alone"]
    for name in ("idle", "fair", "one tenant"):
        b = results[name]["b"]
        assert b["completed"] > 0 and b["by_status"] == {"OK": b["completed"]}, (name, b)
    for name, r in results.items():
        assert r["server_generated_tokens_per_s"] > 0, (name, r)
    assert results["idle"]["fairness_preemptions"] == 0
    assert results["fair"]["fairness_preemptions"] > 0, results["fair"]
    assert results["one tenant"]["fairness_preemptions"] == 0, results["one tenant"]
    assert results["A alone"]["fairness_preemptions"] == 0, results["A alone"]
    assert (results["fair"]["b"]["ttft_p50_s"] * 4
            < results["one tenant"]["b"]["ttft_p50_s"]), results
