"""Density schedules: the fraction of each tensor's coordinates sent at a given step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from lightning_sparse._utils import check_density


class DensitySchedule(ABC):
    """Base class of density schedules.

    A schedule is deterministic given its state, picklable, and round-trips through
    :meth:`state_dict` / :meth:`load_state_dict` so a resumed run continues where it stopped.

    Example:
        >>> ConstantDensity(0.01).density(step=123)
        0.01
    """

    @abstractmethod
    def density(self, step: int) -> float:
        """The density in (0, 1] to use at optimizer step ``step``."""

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
    """The same density at every step.

    Args:
        density: fraction of coordinates sent, in (0, 1].

    Example:
        >>> ConstantDensity(0.001).density(step=0)
        0.001
    """

    def __init__(self, density: float = 0.01) -> None:
        self._density = check_density("density", density)

    def density(self, step: int) -> float:
        return self._density

    def config(self) -> dict[str, Any]:
        return {"density": self._density}


def as_schedule(density: float | DensitySchedule) -> DensitySchedule:
    """Accept a plain density or a schedule; a plain number becomes :class:`ConstantDensity`."""
    if isinstance(density, DensitySchedule):
        return density
    return ConstantDensity(check_density("density", density))
