"""torchmetrics Metrics for the compression figures, synchronised across ranks the torchmetrics way.

Each metric keeps additive states (bytes, element counts, seconds, steps) whose ``dist_reduce_fx``
is ``"sum"``, so ``compute()`` on any rank gives the figure of all ranks together: the traffic
ratio (dense all-reduce wire bytes / wire bytes, ring model), the mean bytes sent and moved per
rank and step, and so on. Feed them the
hook's counters (``strategy.sparse_state.telemetry.last`` after each optimizer step)::

    from lightning_sparse.telemetry.metrics import CompressionRatio

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.ratio = CompressionRatio()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.ratio.update(self.trainer.strategy.sparse_state.telemetry.last)
            self.log("ratio_all_ranks", self.ratio, on_step=False, on_epoch=True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_sparse.telemetry.stats import Counters

__all__ = ["BytesSent", "CompressTime", "CompressionRatio", "Density", "MessageRatio", "ResidualNorm", "WireBytes"]


def _check_steps(steps: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not allowed: expected an integer >= 1.")
    return steps


class _CounterMetric(Metric):
    """A metric over additive counters, summed over updates and over ranks."""

    is_differentiable = False
    full_state_update = False
    _int_states: tuple[str, ...] = ()
    _float_states: tuple[str, ...] = ()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in self._int_states:
            self.add_state(name, default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        for name in self._float_states:
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def _state(self, name: str) -> Tensor:
        state: Tensor = getattr(self, name)
        return state

    def _add(self, **values: float) -> None:
        for name, value in values.items():
            state: Tensor = getattr(self, name)
            state += value


class _RatioMetric(_CounterMetric):
    """``numerator / denominator`` of two counters, each summed over updates and ranks (1.0 while
    the denominator is 0)."""

    _ratio: tuple[str, str] = ("", "")

    def update(self, counters: Counters) -> None:
        """Add one step's (or any span's) counters."""
        self._add(**{name: getattr(counters, name) for name in self._ratio})

    def compute(self) -> Tensor:
        numerator, denominator = (getattr(self, name).double() for name in self._ratio)
        if float(denominator) == 0.0:
            return torch.tensor(1.0, dtype=torch.float64, device=self.device)
        return numerator / denominator


class CompressionRatio(_RatioMetric):
    """Dense wire bytes / wire bytes (``Counters.compression_ratio``): the traffic a dense
    all-reduce would move through the ranks over the traffic of what was sent (ring model), over
    all updates and (when synchronised) all ranks; 1.0 when nothing crossed the wire.

    Example:
        >>> from lightning_sparse.telemetry.stats import Counters
        >>> m = CompressionRatio()
        >>> m.update(Counters(dense_bytes=4000, sent_bytes=100, dense_wire_bytes=6000.0, wire_bytes=300.0))
        >>> float(m.compute())
        20.0
    """

    higher_is_better = True
    _float_states = _ratio = ("dense_wire_bytes", "wire_bytes")


class MessageRatio(_RatioMetric):
    """Dense bytes / bytes sent (``Counters.message_ratio``): message sizes, whatever the
    collectives move; over all updates and (when synchronised) all ranks.

    Example:
        >>> from lightning_sparse.telemetry.stats import Counters
        >>> m = MessageRatio()
        >>> m.update(Counters(dense_bytes=4000, sent_bytes=100))
        >>> float(m.compute())
        40.0
    """

    higher_is_better = True
    _int_states = _ratio = ("dense_bytes", "sent_bytes")


class Density(_RatioMetric):
    """Fraction of gradient coordinates sent (dense parts count in full).

    Example:
        >>> from lightning_sparse.telemetry.stats import Counters
        >>> m = Density()
        >>> m.update(Counters(numel=1000, sent_numel=10))
        >>> float(m.compute())
        0.01
    """

    higher_is_better = False
    _int_states = _ratio = ("sent_numel", "numel")


class BytesSent(_CounterMetric):
    """Bytes put into collectives per rank and step (mean over updates and ranks).

    ``total`` (a state) holds the bytes of all updates and, after ``compute()``, of all ranks.

    Example:
        >>> from lightning_sparse.telemetry.stats import Counters
        >>> m = BytesSent()
        >>> m.update(Counters(sent_bytes=300), steps=3)
        >>> float(m.compute())
        100.0
    """

    higher_is_better = False
    _int_states = ("total", "steps")

    def update(self, counters: Counters, steps: int = 1) -> None:
        """Add the counters of ``steps`` optimizer steps."""
        self._add(total=counters.sent_bytes, steps=_check_steps(steps))

    def compute(self) -> Tensor:
        return self._state("total").double() / self._state("steps").clamp(min=1).double()


class WireBytes(_CounterMetric):
    """Bytes moved through a rank per step by the collectives it issued, ring model (mean over
    updates and ranks): an all-gather of ``m`` bytes per rank ``(W-1)*m``, an all-reduce of ``n``
    bytes ``2*(W-1)/W*n``.

    Example:
        >>> from lightning_sparse.telemetry.stats import Counters
        >>> m = WireBytes()
        >>> m.update(Counters(sent_bytes=100, wire_bytes=300.0), steps=3)
        >>> float(m.compute())
        100.0
    """

    higher_is_better = False
    _int_states = ("steps",)
    _float_states = ("total",)

    def update(self, counters: Counters, steps: int = 1) -> None:
        """Add the counters of ``steps`` optimizer steps."""
        self._add(total=counters.wire_bytes, steps=_check_steps(steps))

    def compute(self) -> Tensor:
        return self._state("total") / self._state("steps").clamp(min=1).double()


class CompressTime(_CounterMetric):
    """Milliseconds per step spent in the communication hook (mean over updates and ranks).

    Example:
        >>> from lightning_sparse.telemetry.stats import Counters
        >>> m = CompressTime()
        >>> m.update(Counters(compress_seconds=0.004), steps=2)
        >>> round(float(m.compute()), 6)
        2.0
    """

    higher_is_better = False
    _int_states = ("steps",)
    _float_states = ("seconds",)

    def update(self, counters: Counters, steps: int = 1) -> None:
        """Add the counters of ``steps`` optimizer steps."""
        self._add(seconds=counters.compress_seconds, steps=_check_steps(steps))

    def compute(self) -> Tensor:
        return 1000.0 * self._state("seconds") / self._state("steps").clamp(min=1).double()


class ResidualNorm(Metric):
    """L2 norm of the error-feedback residuals of all ranks together (the gradient not sent yet).

    Each rank passes the norm of its own residuals; the latest update counts (a residual is a
    state, not a sum over steps). ``compute()`` returns ``sqrt(sum over ranks of norm**2)``.

    Example:
        >>> m = ResidualNorm()
        >>> m.update(3.0)
        >>> m.update(4.0)
        >>> float(m.compute())
        4.0
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = True  # update() replaces the state; forward() must not add batch states up

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("norm_sq", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, norm: float | Tensor) -> None:
        """Set this rank's residual norm (e.g. ``sparse_state.measure_residual_norm()``)."""
        value = torch.as_tensor(norm, dtype=torch.float64, device=self.device)
        if value.numel() != 1 or not bool(torch.isfinite(value)) or float(value) < 0:
            raise ValueError(f"norm={norm!r} is not allowed: expected one finite number >= 0.")
        self.norm_sq = value.reshape(()) ** 2

    def compute(self) -> Tensor:
        return self.norm_sq.sqrt()
