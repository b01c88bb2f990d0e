"""Updates that went non-finite: counted, warned about, and after too many in a row an error."""

from __future__ import annotations

import warnings

__all__ = ["NonfiniteUpdates"]


class NonfiniteUpdates:
    """The updates one rank dropped as non-finite; after ``limit`` exchanges in a row :attr:`stop` holds the error
    to raise before the next step (outside an exchange: a fault-tolerant one would take it for a failed collective).

    Example:
        >>> n = NonfiniteUpdates()
        >>> n.settle(rank=0, steps=4, limit=0), n.updates, n.streak
        ([], 0, 0)
    """

    def __init__(self) -> None:
        self.updates = 0
        self.streak = 0
        self.exchanges = 0
        self.pending: list[str] = []
        self.stop: FloatingPointError | None = None

    def found(self, name: str) -> None:
        self.updates += 1
        self.pending.append(name)

    def settle(self, rank: int, steps: int, limit: int) -> list[str]:
        """The names dropped since the last call; warns (and arms :attr:`stop`) where there are any. ``steps``: this
        rank's optimizer steps (under ``sync_every`` an update is found where it is folded in, steps later)."""
        names, self.pending = self.pending, []
        if not names:
            self.streak = 0
            return names
        self.streak += 1
        self.exchanges += 1
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        if limit and self.streak >= limit:
            self.stop = FloatingPointError(
                f"lightning_sparse: rank {rank}'s optimizer update was not finite at {self.streak} consecutive "
                f"exchanges, the last after optimizer step {steps} ({shown}): its loss or gradients are NaN or "
                f"infinite at every step (max_nonfinite_steps={limit}; 0 never stops). Under plain DDP every parameter "
                "would be NaN."
            )
        n = self.exchanges
        if n & (n - 1) == 0:
            warnings.warn(
                f"lightning_sparse: rank {rank}'s optimizer step made {shown} non-finite, found after "
                f"optimizer step {steps} ({n} time(s) so far, {self.updates} tensor update(s) in all, logged as "
                "sparse/nonfinite_updates): that update is dropped, the rank's view of them is put back to the global "
                "model and its optimizer state for them is reset, so its next finite gradient counts again. "
                f"{limit or 'No number of'} consecutive non-finite exchanges stop the fit (max_nonfinite_steps).",
                stacklevel=4,
            )
        return names
