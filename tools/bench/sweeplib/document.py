"""The document (docs/benchmarks.md with --write-docs): the words come from
templates/benchmarks.md.tmpl; this module computes the numbers, the table
rows and the command lists, picks the sentences the data supports, and puts
the parts together."""

import functools
import os
import re
import string

from . import REPO
from .analysis import duration_ms
from .grids import (STATIC_TARGET_RATIO, WINDOW_THROUGHPUT_TOLERANCE, WINDOW_TTFT_BUDGET_MS,
                    length_label)

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates",
                        "benchmarks.md.tmpl")

BASELINE_WORDS = {"static_padded": "padded static", "static": "static without padding"}


@functools.lru_cache(maxsize=None)
def _parts():
    """{name: text} of the template's "@@ NAME" parts."""
    with open(TEMPLATE, encoding="utf-8") as f:
        text = f.read()
    chunks = re.split(r"^@@ (\w+)\n", text, flags=re.M)
    return {name: body.rstrip("\n") for name, body in zip(chunks[1::2], chunks[2::2])}


def render(part, **values):
    """The part with its placeholders filled. A list value is a list of
    paragraphs: its placeholder's line and the blank line after it become
    each paragraph followed by a blank line."""
    text = _parts()[part]
    filled = {}
    for key, value in values.items():
        if isinstance(value, list):
            text = text.replace("${%s}\n\n" % key, "${%s}" % key)
            value = "".join(p + "\n\n" for p in value)
        filled[key] = value
    return string.Template(text).substitute(filled)


def _then(part, **values):
    """' ' + the part, to follow other words."""
    return " " + render(part, **values)


def _f(x, digits=1):
    return "%.*f" % (digits, x)


def _ratio(a, b):
    return a / b if b else float("inf")


def _commands(points):
    """The shell lines that rerun the points: each server once, then its
    coalesce-bench runs."""
    lines = []
    seen = set()
    for p in points:
        if p["server_cmd"] not in seen:
            seen.add(p["server_cmd"])
            lines.append(p["server_cmd"] + " &")
        lines.append(p["bench_cmd"])
    return "\n".join(lines)


def write_docs(results, doc_path, img_files):
    meta = results["meta"]
    sec = results["sections"]
    doc_dir = os.path.dirname(os.path.abspath(doc_path))

    def plot(key):
        return os.path.relpath(img_files[key], doc_dir)

    parts = [render(
        "page", command=meta["command"], grid=meta["grid"], commit=meta["commit"],
        dirty=_then("dirty") if meta["dirty"] else "", date=meta["date"],
        cpu_model=meta["cpu_model"], cpus=meta["cpus"], memory=meta["memory"], os=meta["os"],
        load_before=meta["load_before"], load_after=meta["load_after"],
        minutes="%.1f" % (meta["elapsed_s"] / 60),
        results_json=os.path.relpath(os.path.join(REPO, meta["results_json"]), doc_dir))]
    if sec.get("trade"):
        parts.append(_trade(sec, plot("trade")))
    if sec.get("static"):
        parts.append(_static(sec, plot("static")))
    if sec.get("window"):
        parts.append(_window(sec, plot("window")))
    if results.get("failures"):
        parts.append(render("failures", failures="\n".join("* " + f
                                                            for f in results["failures"])))
    with open(doc_path, "w") as f:
        f.write("\n\n".join(parts).rstrip() + "\n")


def _trade(sec, plot):
    g = sec["trade"]["grid"]
    a = sec["trade"]["analysis"]
    pts = sec["trade"]["points"]
    models = []
    for model, s in a.items():
        if s["c_knee"] == s["c_last"]:
            knee = render("trade_no_knee", tps_last=_f(s["tps_last"]))
        else:
            falls = (_then("trade_falls", tps_last=_f(s["tps_last"]), c_last="%d" % s["c_last"])
                     if s["tps_last"] < 0.95 * s["tps_peak"] else "")
            knee = render(
                "trade_knee", tps_peak=_f(s["tps_peak"]), c_peak="%d" % s["c_peak"],
                peak_growth="%.1f" % _ratio(s["tps_peak"], s["tps_first"]),
                c_first="%d" % s["c_first"], c_knee="%d" % s["c_knee"],
                itl_knee=_f(s["itl_knee_ms"], 2),
                itl_past_knee="%.1f" % _ratio(s["itl_last_ms"], s["itl_knee_ms"]),
                c_last="%d" % s["c_last"], falls=falls)
        models.append(render(
            "trade_model", model=model, c_first="%d" % s["c_first"], c_last="%d" % s["c_last"],
            tps_first=_f(s["tps_first"]), tps_last=_f(s["tps_last"]),
            tps_growth="%.1f" % _ratio(s["tps_last"], s["tps_first"]),
            itl_first=_f(s["itl_first_ms"], 2), itl_last=_f(s["itl_last_ms"], 2),
            itl_growth="%.1f" % _ratio(s["itl_last_ms"], s["itl_first_ms"]), knee=knee))
    rows = []
    for p in pts:
        s, v = p["summary"], p["server"]
        rows.append("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %d |" % (
            p["params"]["model"], p["params"]["concurrency"], _f(s["tokens_per_s"]),
            _f(s["requests_per_s"], 2), _f(s["itl_p50_ms"], 2), _f(s["tpot_p50_ms"], 2),
            _f(s["ttft_p50_ms"], 1), _f(s["e2e_p50_s"], 3), _f(v["mean_batch_size"]),
            s["failed"]))
    return render(
        "trade", prompt_tokens=g["prompt_tokens"], max_new_tokens=g["max_new_tokens"],
        max_batch_size="%d" % g["max_batch_size"], batch_window=g["batch_window"],
        rounds="%d" % g["rounds"], min_requests="%d" % g["min_requests"], models=models,
        plot=plot, rows="\n".join(rows), commands=_commands(pts))


def _static(sec, plot):
    g = sec["static"]["grid"]
    a = sec["static"]["analysis"]
    pts = sec["static"]["points"]
    findings = []
    for s in a:
        missed = "" if s["target_met"] else _then(
            "static_missed",
            throughput="reaches" if s["ratio"] >= STATIC_TARGET_RATIO else "below",
            target="%g" % STATIC_TARGET_RATIO,
            latency="no worse" if s["latency_no_worse"] else "worse")
        findings.append(render(
            "static_pair", batch="%d" % s["max_batch_size"], label=length_label(s["lengths"]),
            baseline=BASELINE_WORDS["static_padded" if s["baseline"] == "static_padded"
                                    else "static"],
            ratio="%.2f" % s["ratio"], tps_iteration=_f(s["tps_iteration"]),
            tps_static=_f(s["tps_static"]), e2e_iteration=_f(s["e2e_p50_iteration_s"], 3),
            e2e_static=_f(s["e2e_p50_static_s"], 3),
            verdict="met" if s["target_met"] else "not met", missed=missed,
            batch_static=_f(s["batch_static"]), batch_iteration=_f(s["batch_iteration"])))
    # Why the ratio depends on the batch size: how much this engine gains
    # from a fuller batch, from the batching trade measured above.
    trade = {p["params"]["concurrency"]: p["summary"]["tokens_per_s"]
             for p in (sec.get("trade") or {}).get("points", [])
             if p["params"]["model"] == g["model"]}
    halves = [(b // 2, b) for b in g["max_batch_sizes"] if b // 2 in trade and b in trade]
    if halves and a:
        fuller = [s["batch_iteration"] / s["batch_static"] for s in a if s["batch_static"]]
        findings.append(render(
            "static_occupancy", fuller_min="%.1f" % min(fuller), fuller_max="%.1f" % max(fuller),
            gains="; ".join(render("static_gain", c="%d" % b, growth="%.2f" % (trade[b] / trade[h]),
                                   half="%d" % h) for h, b in halves)))
    rows = []
    for p in pts:
        s, v = p["summary"], p["server"]
        rows.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d |" % (
            p["params"]["max_batch_size"], length_label(p["params"]["lengths"]),
            p["params"]["batching"], _f(s["tokens_per_s"]),
            _f(s["tokens_per_s_with_drain"]), _f(s["e2e_p50_s"], 3), _f(s["e2e_p99_s"], 3),
            _f(s["ttft_p50_ms"]), _f(s["tokens_per_request"]), _f(v["mean_batch_size"]),
            s["failed"]))
    return render(
        "static", model=g["model"],
        batch_sizes=" and ".join(str(b) for b in g["max_batch_sizes"]),
        batch_window=g["batch_window"], prompt_tokens=g["prompt_tokens"],
        lengths=" and ".join(render("static_lengths", label=length_label(l), lengths=l)
                             for l in g["lengths"]),
        warmup=g["warmup"], duration=g["duration"], target="%g" % STATIC_TARGET_RATIO,
        findings=findings, plot=plot, rows="\n".join(rows), commands=_commands(pts))


def _window(sec, plot):
    g = sec["window"]["grid"]
    a = sec["window"]["analysis"]
    pts = sorted(sec["window"]["points"], key=lambda p: p["params"]["batch_window_ms"])
    cal = sec["window"].get("calibration")
    first, last = pts[0], pts[-1]
    if cal:
        how = render("window_rate_measured", load="%g" % g["load"],
                     concurrency="%d" % g["max_batch_size"],
                     window_ms="%g" % pts[0]["params"]["batch_window_ms"],
                     capacity=_f(cal["params"]["capacity_requests_per_s"], 2))
    else:
        how = render("window_rate_given")
    # The verdict: the window the rule picks, against the server's default.
    cur = a.get("current_default")
    cur_ms = duration_ms(cur)
    if a["supported_ms"] is None:
        verdict = render("window_none", budget_ms="%g" % WINDOW_TTFT_BUDGET_MS)
    else:
        verdict = render("window_supported", supported_ms="%g" % a["supported_ms"])
    if cur is None:
        default = _then("window_default_unknown")
    elif a["supported_ms"] is not None and cur_ms is not None and \
            abs(cur_ms - a["supported_ms"]) < 1e-9:
        default = _then("window_default_agrees", current=cur)
    else:
        in_grid = [p for p in pts if cur_ms is not None and
                   abs(p["params"]["batch_window_ms"] - cur_ms) < 1e-9]
        detail = ""
        if in_grid:
            s = in_grid[0]["summary"]
            detail = _then("window_default_detail", current=cur, tps=_f(s["tokens_per_s"]),
                           ttft=_f(s["ttft_p50_ms"]), ttft0=_f(a["ttft0_p50_ms"]),
                           base_ms="%g" % a["base_window_ms"])
        default = _then("window_default_differs", current=cur, detail=detail,
                        status="eligible but not the smallest, so not supported"
                        if cur_ms in a["eligible_ms"] else "not supported")
    rows = []
    for p in pts:
        s, v = p["summary"], p["server"]
        rows.append("| %g ms | %s | %s | %s | %s | %s | %s | %s | %d |" % (
            p["params"]["batch_window_ms"], _f(s["ttft_p50_ms"]), _f(s["ttft_p99_ms"]),
            _f(s["tokens_per_s"]), _f(s["e2e_p50_s"], 3), _f(v["mean_batch_size"], 2),
            _f(v["mean_window_wait_ms"], 2), _f(v["tokens_per_engine_s"]), s["failed"]))
    return render(
        "window", rate=_f(pts[0]["params"]["rate"], 2), how=how, model=g["model"],
        max_batch_size="%d" % g["max_batch_size"], prompt_tokens=g["prompt_tokens"],
        max_new_tokens=g["max_new_tokens"], warmup=g["warmup"], duration=g["duration"],
        first_ms="%g" % first["params"]["batch_window_ms"],
        last_ms="%g" % last["params"]["batch_window_ms"],
        ttft_p50_first=_f(first["summary"]["ttft_p50_ms"]),
        ttft_p50_last=_f(last["summary"]["ttft_p50_ms"]),
        ttft_p99_first=_f(first["summary"]["ttft_p99_ms"]),
        ttft_p99_last=_f(last["summary"]["ttft_p99_ms"]),
        tps_first=_f(first["summary"]["tokens_per_s"]),
        tps_last=_f(last["summary"]["tokens_per_s"]),
        batch_first=_f(first["server"]["mean_batch_size"]),
        batch_last=_f(last["server"]["mean_batch_size"]),
        engine_first=_f(first["server"]["tokens_per_engine_s"]),
        engine_last=_f(last["server"]["tokens_per_engine_s"]),
        tolerance_pct="%d" % round(100 * WINDOW_THROUGHPUT_TOLERANCE),
        best=_f(a["best_tokens_per_s"]), budget_ms="%g" % WINDOW_TTFT_BUDGET_MS,
        base_ms="%g" % a["base_window_ms"], ttft0=_f(a["ttft0_p50_ms"]),
        eligible=", ".join("%g ms" % w for w in a["eligible_ms"]) or "none",
        verdict_line="\n" + render("window_verdict", verdict=verdict, default=default),
        plot=plot, rows="\n".join(rows),
        commands=_commands(([cal] if cal else []) + pts))
