"""tools/bench/sweep.py end to end on its smallest grid (--grid=smoke:
synthetic:tiny, one or two points a section, seconds): it starts real servers,
drives them with coalesce-bench, and writes results.json, the three plots and
the document. Checks the shapes, never the numbers: throughput on a shared CI
machine proves nothing."""

import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(REPO, "tools", "bench", "sweep.py")
SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(REPO, "build", "bin", "coalesce-server")
BENCH = os.environ.get("COALESCE_BENCH") or os.path.join(REPO, "build", "bin", "coalesce-bench")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = ("tokens_per_s", "requests_per_s", "itl_p50_ms", "ttft_p50_ms", "ttft_p99_ms",
                "e2e_p50_s", "completed", "failed")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    for b in (SERVER, BENCH):
        if not os.path.exists(b):
            pytest.fail("binary not found: %s (set COALESCE_SERVER, COALESCE_BENCH)" % b)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.fail("matplotlib missing: apt-get install python3-matplotlib (tools/install-deps.sh)")
    out = tmp_path_factory.mktemp("sweep")
    doc = out / "docs" / "benchmarks.md"
    cmd = [sys.executable, SWEEP, "--grid=smoke", "--server_bin=" + SERVER,
           "--bench_bin=" + BENCH, "--build=" + str(out), "--write-docs=" + str(doc)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, "%s\nexit %d\nstderr:\n%s" % (" ".join(cmd), r.returncode, r.stderr)
    data_dir = out / "docs" / "benchmarks"
    return {"doc": doc, "dir": data_dir,
            "results": json.loads((data_dir / "results.json").read_text())}


def check_point(p):
    for k in SUMMARY_KEYS:
        v = p["summary"][k]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, (p["name"], k, v)
    assert p["summary"]["completed"] > 0 and p["summary"]["failed"] == 0, p["summary"]
    assert p["report"]["counts"]["sent"] == p["report"]["counts"]["completed"]
    assert p["server"]["engine_steps"] > 0, p["server"]
    assert p["server_cmd"].split()[0].endswith("coalesce-server"), p["server_cmd"]
    assert p["bench_cmd"].split()[0].endswith("coalesce-bench"), p["bench_cmd"]


def test_results_are_well_formed(sweep):
    res = sweep["results"]
    meta = res["meta"]
    for k in ("commit", "date", "cpu_model", "cpus", "memory", "command", "elapsed_s"):
        assert meta.get(k) not in (None, ""), (k, meta)
    assert meta["grid"] == "smoke"
    assert res["failures"] == []
    sec = res["sections"]
    assert set(sec) == {"trade", "static", "window"}

    trade = sec["trade"]["points"]
    assert [p["params"]["concurrency"] for p in trade] == [1, 2, 4]
    assert set(sec["trade"]["analysis"]) == {"synthetic:tiny"}

    static = sec["static"]["points"]
    assert sorted((p["params"]["lengths"], p["params"]["batching"]) for p in static) == [
        (lengths, mode) for lengths in ("4:16", "4:16:log")
        for mode in ("continuous", "static", "static_padded")]
    assert all("requests" not in p["report"] for p in static)  # records are dropped
    pairs = sec["static"]["analysis"]
    assert sorted((pair["lengths"], pair["baseline"]) for pair in pairs) == [
        (lengths, baseline) for lengths in ("4:16", "4:16:log")
        for baseline in ("static", "static_padded")]
    for pair in pairs:
        assert pair["ratio"] > 0 and isinstance(pair["target_met"], bool)

    window = sec["window"]
    assert [p["params"]["batch_window_ms"] for p in window["points"]] == [0, 5]
    assert window["calibration"]["params"]["rate"] > 0
    assert all(p["params"]["rate"] == window["calibration"]["params"]["rate"]
               for p in window["points"])
    a = window["analysis"]
    assert a["supported_ms"] in (0, 5) and a["supported_ms"] in a["eligible_ms"]
    # The server's default, read from its --helpfull.
    assert a["current_default"], a

    for p in trade + static + window["points"]:
        check_point(p)


def test_plots_exist(sweep):
    assert set(sweep["results"]["plots"]) == {"trade", "static", "window"}
    for name in sweep["results"]["plots"].values():
        path = sweep["dir"] / name
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, path


def test_document(sweep):
    text = sweep["doc"].read_text()
    assert sweep["results"]["meta"]["commit"] in text
    for heading in ("## The batching trade", "## Iteration-level against static batching",
                    "## The coalescing window"):
        assert heading in text
    for name in sweep["results"]["plots"].values():
        assert "](benchmarks/%s)" % name in text
    assert "The data supports `--batch_window=" in text or "No window meets the rule" in text
    # The static section explains its ratios with the trade's numbers.
    assert "concurrency 4 gives" in text and "tokens/s of concurrency 2" in text
