"""tools/bench/prefix_cache.py --sweep end to end on synthetic:tiny with tiny
prefixes: it starts real servers with caching on and off, drives them with
coalesce-bench, and writes the JSON and the plot; --from_json re-plots it.
Checks the shapes and what the cache must have found, never the speed."""

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "bench", "prefix_cache.py")
SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(REPO, "build", "bin", "coalesce-server")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sweep_writes_its_json_and_plot(tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.fail("matplotlib missing: apt-get install python3-matplotlib (tools/install-deps.sh)")
    data, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    cmd = [sys.executable, SCRIPT, "--sweep", "--model=synthetic:tiny", "--lengths=32,64",
           "--suffix_tokens=4", "--requests=2", "--port=%d" % free_port(),
           "--bin=" + os.path.dirname(SERVER), "--json=" + str(data), "--plot=" + str(png)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, "%s\nexit %d\nstderr:\n%s" % (" ".join(cmd), r.returncode, r.stderr)
    sweep = json.loads(data.read_text())
    assert [p["shared_prefix_tokens"] for p in sweep["points"]] == [32, 64]
    for p in sweep["points"]:
        for key in ("on", "off"):
            assert p[key]["failed"] == 0 and p[key]["completed"] == 2
            assert p[key]["ttft_p50_s"] > 0
        # With caching, the measured requests find the shared prefix's whole
        # blocks (16 tokens each); without, nothing.
        whole = p["shared_prefix_tokens"] // 16 * 16
        assert p["on"]["cached_prompt_tokens"] >= 2 * whole
        assert p["off"]["cached_prompt_tokens"] == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "shared prefix tokens" in r.stdout

    again = tmp_path / "again.png"
    r = subprocess.run([sys.executable, SCRIPT, "--sweep", "--from_json=" + str(data),
                        "--plot=" + str(again)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert again.read_bytes().startswith(PNG_MAGIC)
