"""fp16 AMP: a step that the gradient scaler skips changes nothing of the sparse state, on every rank alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from lightning_sparse._utils import all_finite
from lightning_sparse.wire.comm import Collectives, completed, first_line
from lightning_sparse.wire.memory import ErrorFeedback, LocalMomentum
from lightning_sparse.wire.stats import Counters

__all__ = ["SkippedSteps"]


class SkippedSteps:
    """What the strategies do about the steps an fp16 gradient scaler skips.

    Gradient mode: the residuals (and local momenta) the exchange takes from are put back when the scaler skipped
    the step. Update mode: the ranks agree on an overflow after the backward (one all-reduce of one number); on one
    anywhere every gradient is made NaN, so every scaler skips.

    Args:
        scaler: the precision plugin's gradient scaler (``torch.amp.GradScaler``).

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        >>> _ = scaler.scale(torch.ones(()))          # the step's loss, scaled
        >>> skips = SkippedSteps(scaler)
        >>> memory = ErrorFeedback()
        >>> _ = memory.accumulate("w", torch.tensor([1.0, 2.0]))
        >>> skips.begin()
        >>> skips.keep(memory, LocalMomentum(), ["w"])   # before the exchange takes from "w"
        >>> _ = memory.accumulate("w", torch.tensor([5.0, 5.0]))
        >>> scaler.update(4.0)                            # the scaler backed off: the step was skipped
        >>> skips.after_step(memory, LocalMomentum())
        True
        >>> memory.get("w")
        tensor([1., 2.])
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        #: optimizer steps that every rank skipped because a gradient overflowed somewhere
        self.skipped = 0
        #: update mode: whether a gradient overflowed on some rank in this step (agreed by every rank)
        self.overflowed = False
        self._scale: float | None = None
        self._saved: dict[str, tuple[Tensor | None, Tensor | None]] = {}
        self._buffers: list[Tensor] = []  # update mode: this step's buffers
        self._local_overflow = False

    def scale(self) -> float:
        """The scaler's current loss scale."""
        return float(self.scaler.get_scale())

    def begin(self) -> None:
        """At the start of an optimizer step: note the scale."""
        self._scale = self.scale()
        self._saved.clear()

    def keep(self, memory: ErrorFeedback, velocity: LocalMomentum, names: list[str]) -> None:
        """Copy the residuals (and local momenta) of ``names`` before the exchange takes from them."""
        for name in names:
            if name not in self._saved:
                v = velocity.get(name)
                self._saved[name] = (memory.copy(name), None if v is None else v.clone())

    def after_step(self, memory: ErrorFeedback, velocity: LocalMomentum) -> bool:
        """After the optimizer step: whether the scaler skipped it (its scale went down); then put the copies back."""
        saved, self._saved = self._saved, {}
        if self._scale is None or not self.scale() < self._scale:
            return False
        self._scale = None  # once per step (a second optimizer finds nothing to do)
        self.skipped += 1
        for name, (e, v) in saved.items():
            memory.put(name, e)
            velocity.put(name, v)
        return True

    def agree(
        self,
        comm: Collectives,
        buffer: Tensor,
        is_last: bool,
        counters: Counters,
        error: Callable[[str, str], Exception],
    ) -> Future[Tensor]:
        """Keep ``buffer``; after the step's last, agree on an overflow anywhere and then make every buffer NaN.
        ``error(what, cause)``: the exception raised if that all-reduce fails."""
        if not self._buffers:  # the step's first bucket
            self.overflowed = False
        self._buffers.append(buffer)
        self._local_overflow = self._local_overflow or not all_finite(buffer)
        if not is_last:
            return completed(buffer)
        flag = torch.tensor([1.0 if self._local_overflow else 0.0], device=buffer.device)
        buffers, self._buffers, self._local_overflow = self._buffers, [], False
        issued = comm.all_reduce(flag, counters)

        def settle(done: Future[Any] | None = None) -> Tensor:
            if done is not None and issued is not None:
                try:
                    done.value()
                except Exception as failure:
                    raise error(issued.what, first_line(failure)) from failure
            if float(flag[0]) > 0:
                self.overflowed = True
                self.skipped += 1
                for b in buffers:
                    b.fill_(float("nan"))
            return buffer

        if issued is None:
            return completed(settle())
        return issued.future.then(settle)
