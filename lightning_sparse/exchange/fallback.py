"""Time-based dense fallback: time both ways of sending on this link and keep the faster one."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_sparse._utils import bad_argument, check_int

#: the CPU clock (a module attribute so that a test can stand in its own)
clock: Callable[[], float] = time.perf_counter

T = TypeVar("T")

SPARSE: Literal["sparse"] = "sparse"
DENSE: Literal["dense"] = "dense"
TRIAL_SPARSE, TRIAL_DENSE = "trial sparse", "trial dense"
#: what :meth:`TimedFallback.state_dict` holds
_SAVED = ("choice", "trial_start", "samples", "decisions", "world_size")


class TimedFallback:
    """Send every bucket dense when, on this link, dense steps finish their exchange sooner.

    After the warm-up a trial times ``trial_steps`` dense steps, then as many sparse ones, each from its first
    bucket's hook to its last collective (the first of each half carries the switch and is not counted). The
    ranks take the maximum of their medians, so every rank makes the same choice.

    Args:
        trial_steps: steps of each kind in a trial (>= 2; the first of each is not counted).
        recheck_every: steps from one choice to the next trial (0: decide once).

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> strategy = SparseDDPStrategy(compressor="topk", fallback_to_dense="time")
        >>> strategy.sparse_state.timed_fallback.trial_steps
        5
        >>> TimedFallback(trial_steps=3, recheck_every=1000).trial_length
        6
    """

    def __init__(self, trial_steps: int = 5, recheck_every: int = 0) -> None:
        self.trial_steps = check_int("trial_steps", trial_steps, minimum=2)
        self.recheck_every = check_int("recheck_every", recheck_every, minimum=0)
        self.choice: Literal["sparse", "dense"] | None = None
        self.trial_start: int | None = None
        self.samples: dict[str, list[float]] = {SPARSE: [], DENSE: []}
        self.decisions: list[dict[str, Any]] = []
        self.world_size: int | None = None
        self._group: dist.ProcessGroup | None = None
        self._device = torch.device("cpu")
        self._open: tuple[str, Any, list[Any]] | None = None
        self._world: int | None = None
        self._warmup = 1

    def __repr__(self) -> str:
        return f"TimedFallback(trial_steps={self.trial_steps}, recheck_every={self.recheck_every})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_group=None, _open=None)
        return state

    @property
    def trial_length(self) -> int:
        """Steps in one trial (both kinds)."""
        return 2 * self.trial_steps

    def config(self) -> dict[str, int]:
        return {"trial_steps": self.trial_steps, "recheck_every": self.recheck_every}

    def setup(
        self, process_group: dist.ProcessGroup | None, world_size: int, warmup_steps: int, device: torch.device
    ) -> None:
        """Bind to the process group (a restored choice is kept for the same world size)."""
        self._group, self._device, self._world, self._warmup = process_group, device, world_size, warmup_steps
        self._open = None
        self._reconcile()

    def _reconcile(self) -> None:
        if self._world is None:
            return
        if self.world_size is not None and self.world_size != self._world:
            self.choice, self.trial_start = None, None
            self.samples = {SPARSE: [], DENSE: []}
        self.world_size = self._world

    def kind(self, step: int) -> str:
        """How step ``step`` sends its sparse buckets (``"sparse"``, ``"dense"``, ``"trial sparse"``, ...)."""
        if self._world is None or self._world <= 1:
            return SPARSE  # one process: nothing to time
        trial = self._trial_offset(step)
        if trial is not None:
            return TRIAL_DENSE if trial < self.trial_steps else TRIAL_SPARSE
        return self.choice or SPARSE

    def _trial_offset(self, step: int) -> int | None:
        """``step``'s place in the trial (None outside one)."""
        start = self.trial_start
        return step - start if start is not None and start <= step < start + self.trial_length else None

    def begin_step(self, step: int) -> int:
        """At the first bucket of a step: close the last window, choose after a trial; returns bytes sent."""
        self._close_window()
        if self._world is None or self._world <= 1:
            return 0
        if self.choice is None and self.trial_start is None:
            self.trial_start = max(step, self._warmup)
        start = self.trial_start
        sent = self._decide(step) if start is not None and step >= start + self.trial_length else 0
        trial = self._trial_offset(step)
        if trial is not None and trial % self.trial_steps:  # the first step of each half is not timed
            self._open = (DENSE if trial < self.trial_steps else SPARSE, self._now(), [])
        return sent

    def track(self, future: Future[T]) -> Future[T]:
        """Chain ``future`` so that its completion time joins the open window (if any)."""
        if self._open is None:
            return future
        ends = self._open[2]

        def done(fut: Future[T]) -> T:
            value = fut.value()
            ends.append(self._now())  # list.append: safe from the process group's threads
            return value

        return future.then(done)

    def mark_end(self) -> None:
        """The step's work ends now (update mode: after the exchange that follows the optimizer step)."""
        if self._open is not None:
            self._open[2].append(self._now())

    def _now(self) -> Any:
        if self._device.type == "cuda":
            # callbacks of CUDA futures run when the work is enqueued: mark the stream instead
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return clock()

    def _close_window(self) -> None:
        if self._open is None:
            return
        kind, begin, ends = self._open
        self._open = None
        if not ends:
            return
        if isinstance(begin, torch.cuda.Event):
            for end in ends:
                end.synchronize()
            window = max(begin.elapsed_time(end) for end in ends) / 1e3
        else:
            window = max(ends) - begin
        self.samples[kind].append(float(window))

    def _decide(self, step: int) -> int:
        """Agree on the trial's medians (slowest rank's) and choose; returns bytes sent."""
        medians = [statistics.median(self.samples[k]) if self.samples[k] else float("inf") for k in (SPARSE, DENSE)]
        # max is exact, so every rank ends with the same bits and the same choice
        t = torch.tensor(medians, dtype=torch.float64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        sparse_s, dense_s = t.cpu().tolist()
        self.choice = SPARSE if sparse_s <= dense_s else DENSE  # a tie keeps the smaller messages
        self.decisions.append(
            dict(step=step, sparse_s=sparse_s, dense_s=dense_s, choice=self.choice, trial_start=self.trial_start)
        )
        self.samples = {SPARSE: [], DENSE: []}
        self.trial_start = step + self.recheck_every if self.recheck_every else None
        return t.numel() * t.element_size()

    def describe(self) -> str | None:
        """One line on the last choice, for summaries (None before the first)."""
        if not self.decisions:
            return None
        d = self.decisions[-1]
        return (
            f"timed fallback at step {d['step']}: exchange window sparse {1e3 * d['sparse_s']:.1f} ms, "
            f"dense {1e3 * d['dense_s']:.1f} ms (trial median, slowest rank) -> {d['choice']}"
        )

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy({name: getattr(self, name) for name in _SAVED})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in _SAVED:
            setattr(self, name, copy.deepcopy(state[name]))
        self._open = None
        self._reconcile()


def as_fallback(value: Any) -> tuple[bool, TimedFallback | None]:
    """``fallback_to_dense`` -> (byte rule on, timed fallback or None)."""
    if isinstance(value, TimedFallback):
        return True, value
    if value is True or value == "bytes":
        return True, None
    if value is False:
        return False, None
    if value == "time":
        return True, TimedFallback()
    raise bad_argument(
        "fallback_to_dense",
        value,
        "expected True or 'bytes' (dense when sparse moves at least as many bytes), 'time' or a TimedFallback "
        "(also dense when sparse steps are measured slower), or False",
    )
