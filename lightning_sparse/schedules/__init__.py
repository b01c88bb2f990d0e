"""Density schedules: the fraction of each tensor's coordinates sent at a given step.

``SparseDDPStrategy(density=0.01)`` is :class:`ConstantDensity`; ``density=`` also takes a schedule:

- :class:`ConstantDensity` - the same density every step;
- :class:`WarmupDensity` - from dense-ish to sparse over the first steps (as DGC does);
- :class:`AdaptiveDensity` - every step, the density that maximises the objective improvement
  per communicated bit, ``k* = argmax_k ||Top_k(p)||^2 / C(k)`` (Khirirat, Magnusson, Aytekin and
  Johansson), with every rank choosing the same ``k``.

The hook calls ``schedule.density(step)`` for every bucket it sends sparse. Schedules that need to
see the gradients set ``observes = True``: the hook then calls :meth:`DensitySchedule.observe` with
``p = gradient + residual`` of every sparse tensor before compressing it, and
:meth:`DensitySchedule.end_step` once at the end of every optimizer step. Both run on the thread
that runs the hook, in the same order on every rank, so a schedule may launch a collective from
``end_step`` (never from a future's callback).
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
