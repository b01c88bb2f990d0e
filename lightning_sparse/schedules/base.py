"""Density schedules: the base class, the constant and warm-up schedules, and ``density=`` parsing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from lightning_sparse._utils import bad_argument, check_density, check_int
from lightning_sparse.wire import WireContext


class DensitySchedule(ABC):
    """Base class of density schedules: deterministic given their state, picklable, resumed through
    :meth:`state_dict` / :meth:`load_state_dict`.

    The hook calls :meth:`density` for every bucket it sends sparse; with ``observes = True`` also :meth:`observe`
    for every sparse tensor and :meth:`end_step` once a step, in the same order on every rank.

    Example:
        >>> ConstantDensity(0.01).density(step=123)
        0.01
    """

    #: whether the hook calls :meth:`observe` with every sparse tensor (it costs a pass over p)
    observes: ClassVar[bool] = False
    #: the density of every step, where it never changes: the hook reads it instead of calling :meth:`density`
    constant: float | None = None

    @abstractmethod
    def density(self, step: int) -> float:
        """The density in (0, 1] to use at optimizer step ``step``."""

    def setup(self, ctx: WireContext, device: torch.device, grad_dtype: torch.dtype) -> None:  # noqa: B027
        """Called on every rank when the hook is bound to its process group (collectives allowed)."""

    def observe(self, step: int, bucket: str, name: str, p: Tensor) -> None:  # noqa: B027
        """See ``p`` (gradient + residual, flat) of sparse parameter ``name`` of ``bucket`` at ``step``, before it is
        compressed, non-finite or not (if :attr:`observes`); every rank observes the same parameters. Must not
        communicate."""

    def end_step(self, step: int) -> int:
        """Called at the end of optimizer step ``step`` on every rank, after the step's collectives were launched; may
        launch one small all-gather. Returns the bytes this rank handed to it."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """The schedule's mutable state (empty for stateless schedules)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default
        """Restore what :meth:`state_dict` returned."""

    def config(self) -> dict[str, Any]:
        """The constructor arguments (for checkpoints and cross-rank consistency checks)."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


class ConstantDensity(DensitySchedule):
    """The same ``density`` (the fraction of coordinates sent, in (0, 1]) at every step.

    Example:
        >>> ConstantDensity(0.001).density(step=0)
        0.001
    """

    def __init__(self, density: float = 0.01) -> None:
        self._density = check_density("density", density)
        if type(self).density is ConstantDensity.density:  # (a subclass's own density() is asked)
            self.constant = self._density

    def density(self, step: int) -> float:
        return self._density

    def config(self) -> dict[str, Any]:
        return {"density": self._density}


class WarmupDensity(DensitySchedule):
    """From ``start`` to ``end`` over the first ``steps`` optimizer steps, then ``end``.

    ``exponential``: ``start * (end / start) ** (step / steps)``, as Deep Gradient Compression's warm-up;
    ``linear``: arithmetic. Steps count from 0, the strategy's dense ``warmup_steps`` included.

    Args:
        start: density at step 0, in (0, 1].
        end: density from step ``steps`` on, in (0, 1].
        steps: length of the warm-up in optimizer steps (>= 1).
        mode: ``"exponential"`` or ``"linear"``.

    Examples:
        >>> s = WarmupDensity(start=0.25, end=0.001, steps=4)
        >>> [round(s.density(t), 5) for t in range(6)]
        [0.25, 0.06287, 0.01581, 0.00398, 0.001, 0.001]
        >>> WarmupDensity(0.5, 0.1, steps=4, mode="linear").density(2)
        0.3
    """

    def __init__(
        self,
        start: float = 0.25,
        end: float = 0.001,
        steps: int = 1000,
        mode: Literal["exponential", "linear"] = "exponential",
    ) -> None:
        self.start = check_density("start", start)
        self.end = check_density("end", end)
        self.steps = check_int("steps", steps, minimum=1)
        if mode not in ("exponential", "linear"):
            raise bad_argument("mode", mode, "expected 'exponential' or 'linear'")
        self.mode = mode

    def density(self, step: int) -> float:
        if step >= self.steps:
            return self.end
        if step <= 0:
            return self.start
        t = step / self.steps
        if self.mode == "exponential":
            return self.start * (self.end / self.start) ** t
        return self.start + (self.end - self.start) * t

    def config(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "steps": self.steps, "mode": self.mode}


def as_schedule(density: float | DensitySchedule) -> DensitySchedule:
    """Accept a plain density or a schedule; a plain number becomes :class:`ConstantDensity`."""
    return density if isinstance(density, DensitySchedule) else ConstantDensity(density)
