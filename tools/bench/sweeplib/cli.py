"""The command line: the arguments, a run of the grid, and --from_results
(the analysis, plots and document again from a previous results.json)."""

import argparse
import datetime
import json
import os
import shlex
import sys
import time

from . import REPO, log
from .analysis import analyze_static, analyze_trade, analyze_window
from .document import write_docs
from .grids import GRIDS, SECTIONS
from .machine import command_output, load_average, machine_info
from .plots import plot_all
from .points import Runner, current_default_window, run_static, run_trade, run_window


def parse_args(argv, description=None):
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(REPO, "build"),
                   help="build folder holding bin/coalesce-server and bin/coalesce-bench")
    p.add_argument("--server_bin", help="coalesce-server (default: BUILD/bin/coalesce-server)")
    p.add_argument("--bench_bin", help="coalesce-bench (default: BUILD/bin/coalesce-bench)")
    p.add_argument("--grid", choices=sorted(GRIDS), default="full")
    p.add_argument("--quick", action="store_const", const="quick", dest="grid",
                   help="the tiny grid (about 1-2 minutes): --grid=quick")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated subset of %s" % ",".join(SECTIONS))
    p.add_argument("--window_rate", type=float,
                   help="open-loop rate of the window section, requests/s (default: the "
                        "grid's load fraction of a capacity measured first)")
    p.add_argument("--out", help="folder for results.json, raw/ and the plots (default: "
                                 "BUILD/sweep, or docs/benchmarks with --write-docs)")
    p.add_argument("--from_results", metavar="RESULTS_JSON",
                   help="run nothing: redo the analysis, plots and document from a previous "
                        "results.json (e.g. after changing how the document is written)")
    p.add_argument("--write-docs", nargs="?", const=os.path.join(REPO, "docs", "benchmarks.md"),
                   dest="write_docs", metavar="PATH",
                   help="also write the document (default docs/benchmarks.md); its plots and "
                        "data go beside it, in benchmarks/")
    args = p.parse_args(argv)
    args.server_bin = args.server_bin or os.path.join(args.build, "bin", "coalesce-server")
    args.bench_bin = args.bench_bin or os.path.join(args.build, "bin", "coalesce-bench")
    for b in (args.server_bin, args.bench_bin) if not args.from_results else ():
        if not os.access(b, os.X_OK):
            p.error("%s not found (build first, e.g. tools/build.sh, or pass --build)" % b)
    args.sections = [s for s in args.sections.split(",") if s]
    bad = set(args.sections) - set(SECTIONS)
    if bad:
        p.error("unknown sections: %s" % ",".join(sorted(bad)))
    if args.out is None:
        if args.write_docs:
            stem = os.path.splitext(os.path.basename(args.write_docs))[0]
            args.out = os.path.join(os.path.dirname(os.path.abspath(args.write_docs)), stem)
        else:
            args.out = os.path.join(args.build, "sweep")
    return args


def redo(args):
    """--from_results: the analysis, plots and document again, from the data."""
    with open(args.from_results) as f:
        results = json.load(f)
    sec = results["sections"]
    if "trade" in sec:
        sec["trade"]["analysis"] = analyze_trade(sec["trade"]["points"])
    if "static" in sec:
        sec["static"]["analysis"] = analyze_static(sec["static"]["points"])
    if "window" in sec:
        default = sec["window"]["analysis"].get("current_default")
        sec["window"]["analysis"] = analyze_window(sec["window"]["points"])
        sec["window"]["analysis"]["current_default"] = default  # as the run's server said
    out_dir = os.path.dirname(os.path.abspath(args.from_results))
    img_files = plot_all(results, out_dir)
    results["plots"] = {k: os.path.relpath(v, out_dir) for k, v in img_files.items()}
    with open(args.from_results, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    if args.write_docs:
        write_docs(results, args.write_docs, img_files)
        log("wrote %s" % args.write_docs)
    return 0


def main(argv, description=None):
    """The sweep; `description` heads --help (tools/bench/sweep.py passes the
    first paragraph of its docstring)."""
    args = parse_args(argv, description)
    try:
        import matplotlib  # noqa: F401  (fail now, not after the sweep)
    except ImportError:
        sys.exit("sweep.py needs matplotlib: apt-get install python3-matplotlib "
                 "(tools/install-deps.sh), and run it with Debian's /usr/bin/python3")
    if args.from_results:
        return redo(args)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    grid = GRIDS[args.grid]
    # The raw files stay out of docs/: results.json holds every report anyway.
    raw_dir = (os.path.join(os.path.abspath(args.build), "sweep-raw") if args.write_docs
               else os.path.join(out_dir, "raw"))
    runner = Runner(args, raw_dir)
    started = time.monotonic()
    shown = ["tools/bench/sweep.py"] + [a for a in argv]
    results = {
        "meta": dict(machine_info(),
                     command=shlex.join(shown),
                     grid=args.grid,
                     commit=command_output(["git", "rev-parse", "HEAD"]) or "unknown",
                     dirty=bool(command_output(["git", "status", "--porcelain",
                                                "--untracked-files=no"])),
                     date=datetime.datetime.now(datetime.timezone.utc).strftime(
                         "%Y-%m-%d %H:%M UTC"),
                     load_before=load_average(),
                     server_bin=os.path.relpath(args.server_bin, REPO),
                     bench_bin=os.path.relpath(args.bench_bin, REPO)),
        "sections": {},
    }
    log("grid %s, sections %s, output %s" % (args.grid, ",".join(args.sections), out_dir))
    if "trade" in args.sections:
        pts = run_trade(runner, grid["trade"])
        results["sections"]["trade"] = {"grid": grid["trade"], "points": pts,
                                        "analysis": analyze_trade(pts)}
    if "static" in args.sections:
        pts = run_static(runner, grid["static"])
        results["sections"]["static"] = {"grid": grid["static"], "points": pts,
                                         "analysis": analyze_static(pts)}
    if "window" in args.sections:
        pts, cal = run_window(runner, grid["window"], args.window_rate)
        analysis = analyze_window(pts)
        analysis["current_default"] = current_default_window(args.server_bin)
        results["sections"]["window"] = {"grid": grid["window"], "points": pts,
                                         "calibration": cal, "analysis": analysis}
    results["meta"]["load_after"] = load_average()
    results["meta"]["elapsed_s"] = time.monotonic() - started
    results["failures"] = runner.failures
    results_path = os.path.join(out_dir, "results.json")
    results["meta"]["results_json"] = os.path.relpath(results_path, REPO)
    img_files = plot_all(results, out_dir)
    results["plots"] = {k: os.path.relpath(v, out_dir) for k, v in img_files.items()}
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    log("wrote %s and %s" % (results_path, ", ".join(sorted(results["plots"].values()))))
    if args.write_docs:
        os.makedirs(os.path.dirname(os.path.abspath(args.write_docs)), exist_ok=True)
        write_docs(results, args.write_docs, img_files)
        log("wrote %s" % args.write_docs)
    if runner.failures:
        log("some requests failed:\n  " + "\n  ".join(runner.failures))
    return 0
