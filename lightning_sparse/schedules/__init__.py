"""Density schedules: the fraction of each tensor's coordinates sent at a given step.

``density=`` takes a number (:class:`ConstantDensity`), :class:`WarmupDensity` or :class:`AdaptiveDensity`.
"""

from lightning_sparse.compressors.base import k_for
from lightning_sparse.schedules.adaptive import AdaptiveDensity
from lightning_sparse.schedules.base import ConstantDensity, DensitySchedule, WarmupDensity, as_schedule
from lightning_sparse.schedules.energy import topk_energy

__all__ = [
    "AdaptiveDensity",
    "ConstantDensity",
    "DensitySchedule",
    "WarmupDensity",
    "as_schedule",
    "k_for",
    "topk_energy",
]
