"""tools/bench/long_prompt.py end to end on synthetic:tiny: a real server,
decoding streams and a long prompt, with a step time target and without.
Checks the report's shape, and what the target must have done: beside
decodes, the prompt ran in chunks smaller than itself, while without the
target it ran whole (the 2 ms target is far below what a 200-token chunk
costs beside the decodes even on a fast machine; without it one chunk is the
whole prompt). The bounds themselves are the full run's (docs/performance.md)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "bench", "long_prompt.py")
SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(REPO, "build", "bin", "coalesce-server")


def test_long_prompt_bench_runs_and_the_target_splits_the_prompt(tmp_path):
    data = tmp_path / "long_prompt.json"
    cmd = [sys.executable, SCRIPT, "--model=synthetic:tiny", "--prompt_tokens=200",
           "--streams=4", "--settle=0.5", "--max_step_time=2ms",
           "--bin=" + os.path.dirname(SERVER), "--json=" + str(data)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, "%s\nexit %d\nstdout:\n%s\nstderr:\n%s" % (
        " ".join(cmd), r.returncode, r.stdout, r.stderr)
    assert "4 streams decoding, a 200-token prompt arrives" in r.stdout, r.stdout
    results = {x["config"]: x for x in json.loads(data.read_text())["results"]}
    assert list(results) == ["target", "off"]
    for name, x in results.items():
        assert x["before"] > 0 and x["alone_ttft"] > 0, x
        for variant in ("plain", "prompt_logprobs"):
            assert x[variant]["ttft"] > 0 and x[variant]["during"] > 0, (name, variant, x)
    # Without the target the whole prompt ran beside the decodes in one step
    # (prompt_logprobs: in chunks of 256 at most, so whole too).
    assert results["off"]["plain"]["chunks"] == [200], results["off"]
    # With it, in several smaller chunks.
    chunks = results["target"]["plain"]["chunks"]
    assert len(chunks) > 1 and max(chunks) < 200 and sum(chunks) <= 200, chunks
