"""The batching sweep behind tools/bench/sweep.py (its docstring says what the
sweep does and how to run it):

  grids.py      the grids and the constants the analysis and document share
  points.py     running the points: servers on the harness of
                tools/harness/coalesce_harness.py, coalesce-bench against them
  analysis.py   the statements of the document, computed from the data
  plots.py      the PNG plots
  document.py   docs/benchmarks.md, rendered from templates/*.md.tmpl
  machine.py    the machine, load and commit the run is recorded with
  cli.py        the command line, the run and --from_results
"""

import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def log(msg):
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)
