"""A run as the convergence benchmark records it: the metric it is judged by, its kind, label and
reference figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_sparse.bench.peers import Peer

DENSE = "dense DDP"


@dataclass(frozen=True)
class Metric:
    """The validation figure a task is judged by.

    Args:
        key: its key in the runs' JSON: ``final_<key>`` and each point's ``<key>``.
        logged: the name the LightningModule logs it under.
        title: its name in tables and plots.
        higher_is_better: accuracy-like (True) or loss-like (False).
        unit: the unit of differences to dense (``points``, ``nats``).
        scale: difference in ``unit`` = ``scale`` x difference of the values.
        diff_format: format of a difference (``"+.2f"``).
        axis: the plots' y-axis label.

    Example:
        >>> VAL_LOSS.better(1.7, 1.8), ACCURACY.better(0.7, 0.8)
        (True, False)
        >>> ACCURACY.diff(0.895, 0.9)
        -0.5
    """

    key: str
    logged: str
    title: str
    higher_is_better: bool
    unit: str
    scale: float = 1.0
    diff_format: str = "+.2f"
    axis: str = ""

    def better(self, a: float, b: float) -> bool:
        """``a`` strictly better than ``b``."""
        return a > b if self.higher_is_better else a < b

    def diff(self, value: float, reference: float) -> float:
        """``value - reference`` in ``unit`` (positive: higher, whatever is better)."""
        return round(self.scale * (value - reference), 12)


ACCURACY = Metric("acc", "val_acc", "accuracy", True, "points", 100.0, "+.2f", "validation accuracy")
VAL_LOSS = Metric("loss", "val_loss", "val loss", False, "nats", 1.0, "+.3f", "validation loss (nats)")


def _kind(run: dict[str, Any]) -> str:
    """``"dense"``, ``"sparse"`` or ``"peer"`` (torch's hook)."""
    if run.get("peer"):
        return "peer"
    return "dense" if run["compressor"] is None else "sparse"


def _mode(run: dict[str, Any]) -> str:
    """A sparse run's mode; runs saved before modes existed compressed gradients."""
    return run.get("mode") or "gradient"


def run_label(run: dict[str, Any]) -> str:
    """The row label of a run: ``dense DDP``, ``topk (update)``, ``PowerSGD rank 4 (torch hook)``.

    Example:
        >>> run_label({"compressor": "topk", "density": 0.01, "mode": "update"})
        'topk (update)'
    """
    kind = _kind(run)
    if kind == "dense":
        return DENSE
    if kind == "peer":
        return Peer.parse(run["peer"]).label
    if run.get("mode") is None:
        return run["compressor"]
    extra = [run["mode"]]
    if run.get("exchange") not in (None, "auto"):
        extra.append(run["exchange"])
    if run.get("value_dtype") not in (None, "float32"):
        extra.append(f"{run['value_dtype']} values")
    return f"{run['compressor']} ({', '.join(extra)})"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ok(run: dict[str, Any]) -> bool:
    return run.get("status") == "ok"


def _final(run: dict[str, Any], metric: Metric) -> float | None:
    return run.get(f"final_{metric.key}")


def _reference(runs: list[dict[str, Any]], metric: Metric = ACCURACY) -> tuple[float | None, float | None]:
    """(dense metric, dense bytes) of a task: its dense run's, else (None, another run's dense_bytes)."""
    dense = next((r for r in runs if _kind(r) == "dense" and _ok(r)), None)
    if dense is not None:
        return _final(dense, metric), float(dense["sent_bytes"])
    other = next((r for r in runs if _ok(r)), None)
    return None, (float(other["dense_bytes"]) if other else None)
