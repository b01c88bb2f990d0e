"""Loss against bytes from a Lightning logger's output: the curve the README plots, from your own logs."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Mapping

__all__ = ["loss_against_bytes"]


def _number(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def loss_against_bytes(
    rows: str | os.PathLike[str] | Iterable[Mapping[str, object]],
    loss: str = "val_loss",
    bytes_column: str = "sparse/bytes_sent_total",
) -> list[tuple[float, float]]:
    """``(bytes sent so far, loss)`` at every logged value of ``loss``, in step order.

    ``rows``: a ``CSVLogger``'s ``metrics.csv``, or any logger's rows as mappings with a ``"step"`` key. The bytes
    are the latest ``bytes_column`` at or before the loss's step; a loss logged before any bytes is left out.

    Example:
        >>> rows = [
        ...     {"step": 9, "sparse/bytes_sent_total": 1000.0, "val_loss": ""},
        ...     {"step": 9, "sparse/bytes_sent_total": "", "val_loss": 0.9},
        ...     {"step": 19, "sparse/bytes_sent_total": 2100.0, "val_loss": ""},
        ...     {"step": 19, "sparse/bytes_sent_total": "", "val_loss": 0.5},
        ... ]
        >>> loss_against_bytes(rows)
        [(1000.0, 0.9), (2100.0, 0.5)]
    """
    if isinstance(rows, (str, os.PathLike)):
        with open(rows, newline="") as f:
            records: list[Mapping[str, object]] = list(csv.DictReader(f))
    else:
        records = list(rows)
    if records and not any(loss in r for r in records):
        raise ValueError(f"loss={loss!r} is not among the logged columns: expected one of {sorted(records[0])}.")
    points = [(_number(r.get("step")), _number(r.get(bytes_column)), _number(r.get(loss))) for r in records]
    sent = [(step, b) for step, b, _ in points if step is not None and b is not None]
    losses = [(step, value) for step, _, value in points if step is not None and value is not None]
    out = []
    for step, value in sorted(losses, key=lambda sv: sv[0]):
        before = [b for s, b in sent if s <= step]
        if before:
            out.append((max(before), value))
    return out
