"""The scale benchmark's plot: MB per rank per step against the number of ranks."""

from __future__ import annotations

from typing import Any

from benchmarks.scale.model import DENSE


def plot(result: dict[str, Any], path: str) -> None:
    """MB per rank per step against W (log-log): the model's lines at both sizes, the measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # auto coincides with allgather or split: drawn wide and pale underneath, so both stay visible
    series = {
        DENSE: ("dense", "black", "o", 1.8, 1.0),
        "allgather compact": ("allgather", "tab:red", "s", 1.8, 1.0),
        "split compact": ("split", "tab:blue", "^", 1.8, 1.0),
        "auto": ("auto (defaults)", "tab:green", "o", 7.0, 0.35),
    }
    fig, ax = plt.subplots(figsize=(7.5, 5))
    big, small = result["model"], result["measure_model"]
    for column, (label, color, marker, width, alpha) in series.items():
        for size, style, thin in ((big, "-", 1.0), (small, "--", 0.6)):
            ws = [r["world"] for r in size["rows"]]
            mb = [r["bytes"][column] / 1e6 for r in size["rows"]]
            ax.plot(
                ws, mb, style, color=color, lw=width * thin, alpha=alpha, zorder=1 if column == "auto" else 2,
                label=f"{label}, model {size['size']['params'] / 1e6:.1f}M",
            )  # fmt: skip
        if result["measured"]:
            ws = [r["world"] for r in result["measured"]]
            mb = [r["bytes"][column] / 1e6 for r in result["measured"]]
            big_marker = column == "auto"
            ax.plot(
                ws, mb, marker, color=color, ms=13 if big_marker else 6, mfc="none", mew=2.5 if big_marker else 1.4,
                alpha=0.6 if big_marker else 1.0, zorder=3,
            )  # fmt: skip
    ax.plot([], [], "o", color="gray", mfc="none", mew=1.4, label=f"measured {small['size']['params'] / 1e6:.1f}M")
    worlds = [r["world"] for r in big["rows"]]
    ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_yscale("log")
    ax.set_xlabel("ranks W")
    ax.set_ylabel("MB per rank per step (ring model)")
    ax.set_title(f"top-k {result['density']:g}: wire bytes per rank per step (compact indices)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
