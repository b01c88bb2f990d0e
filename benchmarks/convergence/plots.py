"""The convergence benchmark's plots: the validation metric against cumulative bytes sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.convergence.runs import Metric, _kind, _mode, _ok, run_label
from benchmarks.convergence.tasks import _metric_of


def _variant(run: dict[str, Any]) -> tuple[str, str, str]:
    return (run["compressor"], run.get("exchange") or "auto", run.get("value_dtype") or "")


def _key(run: dict[str, Any]) -> str | tuple[str, str, str]:
    """What gets its own color: the compressor and way of sending, and a run's own settings of local
    steps, outer step, coded values or warm-up."""
    if any(run.get(k) not in (None, 1) for k in ("sync_every", "outer_optimizer", "value_bits", "warmup_steps")):
        return run_label(run)
    return _variant(run)


def plot(task: str, runs: list[dict[str, Any]], path: Path, metric: Metric | None = None) -> bool:
    """The validation metric against cumulative bytes sent (log x), one panel per density; dense DDP and
    torch's hooks in every panel; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = _metric_of(task, metric)
    sparse = [r for r in runs if _kind(r) == "sparse"]
    densities = sorted({r["density"] for r in sparse}, reverse=True) or [1.0]
    # one color per compressor and way of sending (exchange, value dtype)
    compressors = list(dict.fromkeys(_key(r) for r in sparse))
    modes = list(dict.fromkeys(_mode(r) for r in sparse))
    cmap = plt.get_cmap("tab10")
    colors = {c: cmap(i % 10) for i, c in enumerate(compressors)}
    # compressors that select the same coordinates (e.g. the exact top-k of topk, gaussiank and dgc)
    # draw the same curve: distinct dash patterns keep each of them visible; with several modes the
    # dash pattern tells the mode instead (update solid, gradient dashed)
    if len(modes) > 1:
        mode_styles = {"update": "-", "gradient": "--"}
        style = {(c, m): mode_styles.get(m, ":") for c in compressors for m in modes}
    else:
        style = {(c, m): ("-", "--", "-.", ":")[i % 4] for i, c in enumerate(compressors) for m in modes}
    references = [r for r in runs if _kind(r) in ("dense", "peer") and _ok(r) and r.get("points")]
    greys = ("black", "dimgray", "darkgray", "saddlebrown", "olive", "slategray")
    fig, axes = plt.subplots(1, len(densities), figsize=(5.2 * len(densities), 4.4), sharex=True, sharey=True)
    axes = list(axes) if len(densities) > 1 else [axes]
    for ax, density in zip(axes, densities, strict=True):
        for i, r in enumerate(references):
            pts = [p for p in r["points"] if metric.key in p]
            dense = _kind(r) == "dense"
            ax.plot(
                [p["sent_bytes"] for p in pts],
                [p[metric.key] for p in pts],
                color=greys[i % len(greys)],
                lw=2.2 if dense else 1.4,
                ls="-" if dense else ":",
                marker="o" if dense else "s",
                ms=3,
                label=run_label(r),
            )
        for r in sparse:
            if r["density"] != density or not r.get("points"):
                continue
            pts = [p for p in r["points"] if metric.key in p]
            c = _key(r)
            ax.plot(
                [p["sent_bytes"] for p in pts],
                [p[metric.key] for p in pts],
                color=colors[c],
                ls=style[(c, _mode(r))],
                lw=1.5,
                marker="o",
                ms=2.5,
                label=run_label(r),
            )
        ax.set_xscale("log")
        ax.set_title(f"density {density:g}" if density < 1 else "dense")
        ax.set_xlabel("cumulative bytes sent per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(metric.axis or metric.title)
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.suptitle(f"{task}: {(metric.axis or metric.title).split(' (')[0]} vs bytes sent (error feedback on)")
    if len(labels) > 8:  # many rows: the legend goes below the plots, one line each
        width, height = fig.get_size_inches()
        legend_height = 0.2 * len(labels)
        fig.set_size_inches(max(width, 7.5), height + legend_height)
        fig.legend(handles, labels, loc="lower center", frameon=False, fontsize="small")
        fig.tight_layout(rect=(0, legend_height / (height + legend_height), 1, 1))
    else:
        fig.legend(handles, labels, loc="center right", frameon=False)
        fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
