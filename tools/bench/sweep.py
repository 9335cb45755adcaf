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

The code is the package beside this script, sweeplib/ (grids, points, analysis,
plots, the document and its template); servers are started and stopped by
tools/harness/coalesce_harness.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweeplib import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:], description=__doc__.split("\n\n")[0]))
