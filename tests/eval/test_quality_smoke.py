"""tools/eval/quality.py end to end in its --tiny run (stories260K, 2 KB of
text, 8 items, 4 tokens per prompt: seconds), with an extra configuration the
server cannot know, so that the skip path runs too: real servers, real
coalesce-eval reports, and a document whose every table cell is one of those
reports' numbers. Checks the shapes and the arithmetic of the document, not
the model's quality."""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUALITY = os.path.join(REPO, "tools", "eval", "quality.py")
SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(REPO, "build", "bin", "coalesce-server")
EVAL = os.environ.get("COALESCE_EVAL") or os.path.join(REPO, "build", "bin", "coalesce-eval")

CONFIGS = [
    "fp32=--dtype=fp32",
    "unknown flag=--dtype=fp32 --no_such_flag_for_the_smoke_test=1",
    "auto=--dtype=auto",  # fp32 on the CPU: the same numbers as the reference
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    for b in (SERVER, EVAL):
        if not os.path.exists(b):
            pytest.fail("binary not found: %s (set COALESCE_SERVER, COALESCE_EVAL)" % b)
    out = tmp_path_factory.mktemp("quality")
    doc = out / "quality.md"
    cmd = [sys.executable, QUALITY, "--tiny", "--server_bin=" + SERVER, "--eval_bin=" + EVAL,
           "--out=%s" % doc, "--work=%s" % (out / "work")]
    for c in CONFIGS:
        cmd.append("--config=" + c)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, "%s\nexit %d\nstderr:\n%s" % (" ".join(cmd), r.returncode, r.stderr)
    reports = {}
    for i in range(len(CONFIGS)):
        path = out / "work" / "stories260K" / ("%d.json" % i)
        if path.exists():
            reports[i] = json.loads(path.read_text())
    return {"doc": doc.read_text(), "stderr": r.stderr, "reports": reports}


def test_an_unknown_flag_is_skipped_with_a_note(run):
    assert set(run["reports"]) == {0, 2}, run["stderr"]
    assert "unknown flag: skipped, the server did not start" in run["stderr"]
    assert "no_such_flag_for_the_smoke_test" in run["stderr"]
    assert "Not measured: the server refused these configurations at start-up:" in run["doc"]
    assert re.search(r"^- unknown flag \(`--dtype=fp32 --no_such_flag_for_the_smoke_test=1`\): "
                     r".*no_such_flag_for_the_smoke_test", run["doc"], re.M), run["doc"]


def table_rows(doc):
    return {cells[0]: cells for cells in (
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in doc.splitlines() if line.startswith(("| fp32 |", "| auto |")))}


def test_every_cell_is_a_report_figure(run):
    rows = table_rows(run["doc"])
    assert set(rows) == {"fp32", "auto"}, rows
    for name, i in (("fp32", 0), ("auto", 2)):
        rep = run["reports"][i]
        cells = rows[name]
        p, mc = rep["perplexity"], rep["multiple_choice"]
        assert p["bytes"] == 2048 and p["scored_tokens"] == p["tokens"] - 1
        assert cells[2] == "%.4f" % p["perplexity"]
        assert cells[4] == "%.4f" % p["bits_per_byte"]
        assert mc["items"] == 8
        for col, key in ((5, "acc"), (6, "acc_norm"), (7, "acc_per_token")):
            assert cells[col] == "%.3f (%d/8)" % (mc[key]["accuracy"], mc[key]["correct"])
        if i == 0:
            assert "agreement" not in rep and cells[8] == "reference"
        else:
            a = rep["agreement"]
            assert a["prompts"] == 16 and a["max_new_tokens"] == 4
            assert cells[8] == "%.4f (%d/%d)" % (a["token_share"], a["identical_tokens"],
                                                 a["compared_tokens"])
            ref = run["reports"][0]["perplexity"]["perplexity"]
            assert cells[3] == "%+.3f%%" % (100 * (p["perplexity"] / ref - 1))
            # The same computation as the reference's: the same numbers.
            assert p["nll"] == run["reports"][0]["perplexity"]["nll"]
            assert a["token_share"] == 1.0 and a["earliest_parting"] is None
            assert cells[9] == "0 of 16"


def test_the_document_names_its_commands(run):
    doc = run["doc"]
    assert doc.startswith("# Quality\n")
    assert "| command | `tools/eval/quality.py --bin=build/bin --tiny" in doc
    # The reference server, and each measured configuration's eval command.
    assert doc.count("build/bin/coalesce-eval --server=") == 2
    assert "--dtype=auto --port=50051" in doc
    assert "--agree_with=localhost:50052 --max_new_tokens=4" in doc
    assert "--text=/usr/share/common-licenses/GPL-3 --max_bytes=2048" in doc
