"""The analysis: the statements of the document, computed from the data."""

import re

from .grids import STATIC_TARGET_RATIO, WINDOW_THROUGHPUT_TOLERANCE, WINDOW_TTFT_BUDGET_MS


def analyze_trade(points):
    out = {}
    for model in dict.fromkeys(p["params"]["model"] for p in points):
        rows = sorted((p for p in points if p["params"]["model"] == model),
                      key=lambda p: p["params"]["concurrency"])
        first = rows[0]["summary"]
        peak = max(rows, key=lambda p: p["summary"]["tokens_per_s"])
        # The knee: the smallest concurrency reaching 90% of the peak.
        knee = next(p for p in rows
                    if p["summary"]["tokens_per_s"] >= 0.9 * peak["summary"]["tokens_per_s"])
        out[model] = {
            "c_first": rows[0]["params"]["concurrency"],
            "tps_first": first["tokens_per_s"],
            "itl_first_ms": first["itl_p50_ms"],
            "c_peak": peak["params"]["concurrency"],
            "tps_peak": peak["summary"]["tokens_per_s"],
            "itl_peak_ms": peak["summary"]["itl_p50_ms"],
            "c_knee": knee["params"]["concurrency"],
            "tps_knee": knee["summary"]["tokens_per_s"],
            "itl_knee_ms": knee["summary"]["itl_p50_ms"],
            "c_last": rows[-1]["params"]["concurrency"],
            "tps_last": rows[-1]["summary"]["tokens_per_s"],
            "itl_last_ms": rows[-1]["summary"]["itl_p50_ms"],
        }
    return out


def analyze_static(points):
    out = []
    settings = sorted({(p["params"]["max_batch_size"], p["params"]["lengths"]) for p in points})
    for size, lengths in settings:
        by = {p["params"]["batching"]: p for p in points
              if (p["params"]["max_batch_size"], p["params"]["lengths"]) == (size, lengths)}
        if "continuous" not in by:
            continue
        it = by["continuous"]["summary"]
        for baseline in ("static_padded", "static"):
            if baseline not in by:
                continue
            st = by[baseline]["summary"]
            ratio = it["tokens_per_s"] / st["tokens_per_s"] if st["tokens_per_s"] else float("inf")
            out.append({
                "max_batch_size": size,
                "lengths": lengths,
                "baseline": baseline,
                "ratio": ratio,
                "tps_iteration": it["tokens_per_s"],
                "tps_static": st["tokens_per_s"],
                "e2e_p50_iteration_s": it["e2e_p50_s"],
                "e2e_p50_static_s": st["e2e_p50_s"],
                "latency_no_worse": it["e2e_p50_s"] <= st["e2e_p50_s"],
                # Sequences per engine step (server; padding rows not counted),
                # the occupancy static batching loses.
                "batch_iteration": by["continuous"]["server"]["mean_batch_size"],
                "batch_static": by[baseline]["server"]["mean_batch_size"],
                "target_met": ratio >= STATIC_TARGET_RATIO and it["e2e_p50_s"] <= st["e2e_p50_s"],
            })
    return out


def analyze_window(points):
    rows = sorted(points, key=lambda p: p["params"]["batch_window_ms"])
    best = max(p["summary"]["tokens_per_s"] for p in rows)
    base = next((p for p in rows if p["params"]["batch_window_ms"] == 0), rows[0])
    ttft0 = base["summary"]["ttft_p50_ms"]
    eligible = [p for p in rows
                if p["summary"]["tokens_per_s"] >= (1 - WINDOW_THROUGHPUT_TOLERANCE) * best
                and p["summary"]["ttft_p50_ms"] <= ttft0 + WINDOW_TTFT_BUDGET_MS]
    return {
        "best_tokens_per_s": best,
        "base_window_ms": base["params"]["batch_window_ms"],
        "ttft0_p50_ms": ttft0,
        "eligible_ms": [p["params"]["batch_window_ms"] for p in eligible],
        "supported_ms": eligible[0]["params"]["batch_window_ms"] if eligible else None,
    }


def duration_ms(text):
    """'5ms' -> 5, '0' -> 0, '1.5s' -> 1500, '500us' -> 0.5; None if unknown."""
    if text is None:
        return None
    if text == "0":
        return 0.0
    total, found = 0.0, False
    for num, unit in re.findall(r"([0-9.]+)(ns|us|ms|s|m|h)", text):
        total += float(num) * {"ns": 1e-6, "us": 1e-3, "ms": 1, "s": 1e3, "m": 6e4,
                               "h": 3.6e6}[unit]
        found = True
    return total if found else None
