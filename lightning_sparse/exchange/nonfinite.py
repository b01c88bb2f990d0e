"""Updates that went non-finite: dropped before they are sent, the rank healed from the global model."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["NonfiniteUpdates", "drop_nonfinite"]


def drop_nonfinite(parts: list[tuple[str, Tensor, Tensor | None, int]], warn: Callable[[str], None]) -> None:
    """Zero each non-finite progress of ``parts`` and ``warn(name)``, with one host read per bucket.

    Example:
        >>> seg = torch.tensor([1.0, float("nan")])
        >>> drop_nonfinite([("w", seg, None, 0)], print)
        w
        >>> seg
        tensor([0., 0.])
        >>> drop_nonfinite([("empty", torch.empty(0), None, 0)], print)  # nothing to drop
    """
    parts = [part for part in parts if part[1].numel()]  # an empty shard (FSDP2) has no largest value
    if not parts:
        return
    largest = torch.stack(torch._foreach_norm([seg for _, seg, _, _ in parts], math.inf))
    finite = torch.isfinite(largest)
    if bool(finite.all()):
        return
    for (name, seg, _, _), ok in zip(parts, finite.tolist(), strict=True):
        if not ok:
            seg.zero_()
            warn(name)


class NonfiniteUpdates:
    """The updates one rank dropped as non-finite; after ``limit`` exchanges in a row :meth:`check` raises,
    before the next step (outside an exchange: a fault-tolerant one would take it for a failed collective).

    Example:
        >>> n = NonfiniteUpdates()
        >>> n.found("w"); n.settle(rank=0, step=3, limit=0)  # doctest: +SKIP
        ['w']
        >>> n.settle(rank=0, step=4, limit=0), n.updates, n.streak
        ([], 0, 0)
    """

    def __init__(self) -> None:
        self.updates = 0
        self.streak = 0
        self.exchanges = 0
        self.pending: list[str] = []
        self._stop: FloatingPointError | None = None

    def found(self, name: str) -> None:
        self.updates += 1
        self.pending.append(name)

    def check(self) -> None:
        if self._stop is not None:
            raise self._stop

    def settle(self, rank: int, step: int, limit: int) -> list[str]:
        names, self.pending = self.pending, []
        if not names:
            self.streak = 0
            return names
        self.streak += 1
        self.exchanges += 1
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        if limit and self.streak >= limit:
            self._stop = FloatingPointError(
                f"lightning_sparse: rank {rank}'s optimizer update was not finite at {self.streak} consecutive "
                f"exchanges, the last at step {step} ({shown}): its loss or gradients are NaN or infinite at every "
                f"step (max_nonfinite_steps={limit}; 0 never stops). Under plain DDP every parameter would be NaN."
            )
        n = self.exchanges
        if n & (n - 1) == 0:
            warnings.warn(
                f"lightning_sparse: rank {rank}'s optimizer step made {shown} non-finite at step {step} ({n} time(s) "
                f"so far, {self.updates} tensor update(s) in all, logged as sparse/nonfinite_updates): that update is "
                "dropped, the rank's view of them is put back to the global model and its optimizer state for them "
                f"is reset, so its next finite gradient counts again. {limit or 'No number of'} consecutive "
                "non-finite exchanges stop the fit (max_nonfinite_steps).",
                stacklevel=4,
            )
        return names
