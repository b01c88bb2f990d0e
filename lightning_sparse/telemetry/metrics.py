"""torchmetrics Metrics for the compression figures, summed over ranks (``compute()`` gives all ranks' figure).
Feed them the hook's counters, e.g. ``strategy.sparse_state.telemetry.last`` after each step."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_sparse._utils import check_int
from lightning_sparse.wire.stats import Counters

__all__ = ["BytesSent", "CompressTime", "CompressionRatio", "Density", "MessageRatio", "ResidualNorm", "WireBytes"]


class _CounterMetric(Metric):
    """A metric of int64 and float64 scalar states, summed over ranks (and by ``_add`` over updates)."""

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

    def _add(self, **values: float) -> None:
        for name, value in values.items():
            state: Tensor = getattr(self, name)
            state += value


class _RatioMetric(_CounterMetric):
    """``numerator / denominator`` of two counters summed over updates and ranks (1.0 while the denominator is 0)."""

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
    """Dense wire bytes / wire bytes (``Counters.compression_ratio``); 1.0 when nothing crossed the wire.

    Example:
        >>> from lightning_sparse.wire.stats import Counters
        >>> m = CompressionRatio()
        >>> m.update(Counters(dense_bytes=4000, sent_bytes=100, dense_wire_bytes=6000.0, wire_bytes=300.0))
        >>> float(m.compute())
        20.0
    """

    higher_is_better = True
    _float_states = _ratio = ("dense_wire_bytes", "wire_bytes")


class MessageRatio(_RatioMetric):
    """Dense bytes / bytes sent (``Counters.message_ratio``).

    Example:
        >>> float(MessageRatio()(Counters(dense_bytes=4000, sent_bytes=100)))  # forward: this update's figure
        40.0
    """

    higher_is_better = True
    _int_states = _ratio = ("dense_bytes", "sent_bytes")


class Density(_RatioMetric):
    """Fraction of gradient coordinates sent (dense parts count in full).

    Example:
        >>> m = Density()
        >>> for sent in (10, 30):
        ...     m.update(Counters(numel=1000, sent_numel=sent))
        >>> float(m.compute())
        0.02
    """

    higher_is_better = False
    _int_states = _ratio = ("sent_numel", "numel")


class _PerStepMetric(_CounterMetric):
    """``_scale`` times the mean per optimizer step of the counter ``_counter``, kept in the state ``_total``."""

    higher_is_better = False
    _counter = ""
    _total = "total"
    _scale = 1.0

    def update(self, counters: Counters, steps: int = 1) -> None:
        """Add the counters of ``steps`` optimizer steps."""
        self._add(**{self._total: getattr(counters, self._counter)}, steps=check_int("steps", steps, minimum=1))

    def compute(self) -> Tensor:
        total, steps = (getattr(self, name).double() for name in (self._total, "steps"))
        return self._scale * total / steps.clamp(min=1)


class BytesSent(_PerStepMetric):
    """Bytes put into collectives per rank and step.

    Example:
        >>> m = BytesSent()
        >>> m.update(Counters(sent_bytes=300), steps=3)
        >>> float(m.compute())
        100.0
    """

    _int_states = ("total", "steps")
    _counter = "sent_bytes"


class WireBytes(_PerStepMetric):
    """Bytes moved through a rank per step by its collectives, ring model.

    Example:
        >>> float(WireBytes()(Counters(sent_bytes=100, wire_bytes=300.0), steps=3))
        100.0
    """

    _int_states = ("steps",)
    _float_states = ("total",)
    _counter = "wire_bytes"


class CompressTime(_PerStepMetric):
    """Milliseconds per step spent in the communication hook.

    Example:
        >>> m = CompressTime()
        >>> m.update(Counters(compress_seconds=0.004), steps=2)
        >>> round(float(m.compute()), 6)
        2.0
    """

    _int_states = ("steps",)
    _float_states = ("seconds",)
    _counter = "compress_seconds"
    _total = "seconds"
    _scale = 1000.0


class ResidualNorm(_CounterMetric):
    """L2 norm of the error-feedback residuals of all ranks together: ``sqrt(sum over ranks of norm**2)`` of each
    rank's latest update.

    Example:
        >>> m = ResidualNorm()
        >>> m.update(3.0)
        >>> m.update(4.0)
        >>> float(m.compute())
        4.0
    """

    higher_is_better = False
    full_state_update = True  # update() replaces the state; forward() must not add batch states up
    _float_states = ("norm_sq",)

    def update(self, norm: float | Tensor) -> None:
        """Set this rank's residual norm (e.g. ``sparse_state.measure_residual_norm()``)."""
        value = torch.as_tensor(norm, dtype=torch.float64, device=self.device)
        if value.numel() != 1 or not bool(torch.isfinite(value)) or float(value) < 0:
            raise ValueError(f"norm={norm!r} is not allowed: expected one finite number >= 0.")
        self.norm_sq = value.reshape(()) ** 2

    def compute(self) -> Tensor:
        return self.norm_sq.sqrt()
