"""The plots: one PNG per section (matplotlib, Agg)."""

import os

from .grids import STATIC_LABELS, STATIC_MODES, length_label


def plot_all(results, img_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    sec = results["sections"]
    if sec.get("trade"):
        pts = sec["trade"]["points"]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
        for model in dict.fromkeys(p["params"]["model"] for p in pts):
            rows = sorted((p for p in pts if p["params"]["model"] == model),
                          key=lambda p: p["params"]["concurrency"])
            c = [p["params"]["concurrency"] for p in rows]
            tps = [p["summary"]["tokens_per_s"] for p in rows]
            itl = [p["summary"]["itl_p50_ms"] for p in rows]
            axes[0].plot(c, tps, "o-", label=model)
            axes[1].plot(c, itl, "o-", label=model)
            axes[2].plot(itl, tps, "o-", label=model)
            for x, y, n in zip(itl, tps, c):
                axes[2].annotate(str(n), (x, y), textcoords="offset points", xytext=(4, -10),
                                 fontsize=7)
        for ax in axes[:2]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (closed loop)")
        axes[0].set_ylabel("generated tokens/s")
        axes[0].set_title("throughput")
        axes[1].set_ylabel("inter-token latency p50 (ms)")
        # Log scales need positive values: on a model so fast that tokens share
        # messages, the p50 gap can be 0 (tools/bench/report.h).
        positive = all(p["summary"]["itl_p50_ms"] > 0 for p in pts)
        if positive:
            axes[1].set_yscale("log")
        axes[1].set_title("per-token latency")
        if positive:
            axes[2].set_xscale("log")
        axes[2].set_xlabel("inter-token latency p50 (ms)")
        axes[2].set_ylabel("generated tokens/s")
        axes[2].set_title("the trade (labels: concurrency)")
        for ax in axes:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files["trade"] = _save(fig, img_dir, "batching_trade.png")

    if sec.get("static"):
        pts = sec["static"]["points"]
        settings = sorted({(p["params"]["max_batch_size"], p["params"]["lengths"]) for p in pts})
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        width = 0.27
        for i, mode in enumerate(STATIC_MODES):
            by = {(p["params"]["max_batch_size"], p["params"]["lengths"]): p["summary"]
                  for p in pts if p["params"]["batching"] == mode}
            if not by:
                continue
            xs = [j + (i - 1) * width for j in range(len(settings))]
            label = STATIC_LABELS[mode]
            axes[0].bar(xs, [by[k]["tokens_per_s"] for k in settings], width, label=label)
            axes[1].bar(xs, [by[k]["e2e_p50_s"] for k in settings], width, label=label)
        for ax in axes:
            ax.set_xticks(range(len(settings)))
            ax.set_xticklabels(["batch %d\n%s" % (b, length_label(l)) for b, l in settings],
                               fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        axes[0].set_ylabel("generated tokens/s")
        axes[0].set_title("throughput")
        axes[1].set_ylabel("end-to-end latency p50 (s)")
        axes[1].set_title("median latency")
        fig.tight_layout()
        files["static"] = _save(fig, img_dir, "static_vs_iteration.png")

    if sec.get("window"):
        rows = sorted(sec["window"]["points"], key=lambda p: p["params"]["batch_window_ms"])
        w = [p["params"]["batch_window_ms"] for p in rows]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        axes[0].plot(w, [p["summary"]["ttft_p50_ms"] for p in rows], "o-", label="p50")
        axes[0].plot(w, [p["summary"]["ttft_p99_ms"] for p in rows], "s--", label="p99")
        axes[0].set_ylabel("time to first token (ms)")
        axes[0].set_title("time to first token")
        axes[1].plot(w, [p["summary"]["tokens_per_s"] for p in rows], "o-",
                     label="client: generated tokens/s")
        axes[1].plot(w, [p["server"]["tokens_per_engine_s"] for p in rows], "s--",
                     label="server: tokens per engine-busy second")
        axes[1].set_ylabel("tokens/s")
        axes[1].set_title("throughput")
        axes[1].set_ylim(bottom=0)
        for ax in axes:
            ax.set_xscale("symlog", linthresh=1)
            ax.margins(x=0.06)
            ax.set_xlabel("--batch_window (ms)")
            ax.set_xticks(w)
            ax.set_xticklabels(["%g" % x for x in w])
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files["window"] = _save(fig, img_dir, "window.png")
    plt.close("all")
    return files


def _save(fig, img_dir, name):
    os.makedirs(img_dir, exist_ok=True)
    path = os.path.join(img_dir, name)
    fig.savefig(path, dpi=100)
    return path
