"""Update compression: after the optimizer step each rank sends part of ``u = e + delta`` (its unsent progress).

The average goes to the outer step; each rank keeps the rest as ``e`` and trains its own view ``global + e``.
Conservation, exactly, per parameter and rank: ``sent + e_new == e_old + delta``, ``delta = p - (global + e_old)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse._utils import all_finite
from lightning_sparse.exchange.fallback import DENSE, TRIAL_DENSE
from lightning_sparse.exchange.fragment import (
    Bucket,
    Commit,
    Fragment,
    InFlight,
    bucket_parts,
    check_fragments,
    count_local,
    decay_residuals,
    drop_nonfinite,
    fragments_of,
    progress,
    split_fragments,
)
from lightning_sparse.exchange.global_model import CPU, GlobalModel
from lightning_sparse.exchange.handover import average_optimizer_states, flush_exactly, flush_in_rounds
from lightning_sparse.exchange.nonfinite import NonfiniteUpdates
from lightning_sparse.exchange.outer import AddAverage, OuterStep, StagedAverage
from lightning_sparse.exchange.state import SparseState
from lightning_sparse.exchange.step import bucket_rounds
from lightning_sparse.wire import Average
from lightning_sparse.wire.comm import Rounds, run_together
from lightning_sparse.wire.memory import ShapedResiduals

__all__ = ["UpdateExchange", "average_optimizer_states", "split_fragments"]

DEFAULT_BUCKET_BYTES, OFFLOAD_BUCKET_BYTES = 1024 * 1024 * 1024, 25 * 1024 * 1024  # float32 bytes a bucket; offloaded
_T = TypeVar("_T")


class UpdateExchange(GlobalModel):
    """One rank's update mode: after each optimizer step its fragments that are due send part of the unsent progress.

    Args:
        state: the shared :class:`~lightning_sparse.exchange.state.SparseState`, bound by :meth:`bind`.
        bucket_bytes: the most float32 bytes per exchanged bucket (a larger parameter gets its own).
        outer_step: what the global parameters do with the average (default: ``AddAverage``).
        commit: what decides, among groups that may fail, whether an exchange counts (fault tolerance).

    Example:
        >>> from lightning_sparse import SparseState
        >>> model = torch.nn.Linear(4, 2)
        >>> exchange = UpdateExchange(SparseState(compressor="topk", density=0.5))
        >>> exchange.bind(model.named_parameters()); exchange.active  # one process: plain training
        False
    """

    def __init__(
        self,
        state: SparseState,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        outer_step: OuterStep | None = None,
        commit: Commit | None = None,
    ) -> None:
        self.state = state
        self.commit = commit
        if commit is not None:
            commit.exchange = self
        self.bucket_bytes = int(bucket_bytes)
        self.outer_step = AddAverage() if outer_step is None else outer_step
        self.offload = bool(state.config.offload_global)  # the global copy lives in CPU memory
        #: called on entering a timed fallback's plain DDP steps (the strategy averages optimizer states)
        self.on_dense: Callable[[], None] | None = None
        self.nonfinite = NonfiniteUpdates()
        #: called with the names of dropped non-finite updates (the strategy resets their optimizer state)
        self.on_nonfinite: Callable[[list[str]], None] | None = None
        self.due_now = False  # every fragment is due at the next exchange (flush_in_rounds)
        self.stepping = False  # an optimizer step is under way (:meth:`step`): a forward in it is no evaluation
        self._unbind()

    def _unbind(self) -> None:
        """Forget the parameters and everything made for them."""
        self._params: dict[str, Tensor] = {}
        self._names: dict[int, str] = {}
        self._global: dict[str, Tensor] = {}  # by name: views of the fragments' buckets once they exist
        self._synced: dict[str, int] = {}  # the parameter's version when it last got its global value
        self._local: set[str] = set()  # the names whose parameter holds this rank's view
        self._fragments: dict[tuple[str, ...], list[Fragment]] = {}  # by group (one optimizer's parameters)
        self._in_flight: list[InFlight] = []  # exchanges launched and not applied yet (sync_delay)
        self._shaped_residuals = ShapedResiduals()

    def bind(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        process_group: dist.ProcessGroup | None = None,
        *,
        check_consistency: bool = True,
        aliases: Iterable[tuple[str, Tensor]] = (),
    ) -> None:
        """Attach to the parameters and process group; ``aliases``: other tensors (FSDP2's DTensors) of a name."""
        aliases = list(aliases)
        trainable = {n for n, a in aliases if a.requires_grad}  # an alias says whether its tensor trains
        named = [(n, p) for n, p in named_parameters if p.requires_grad or n in trainable]
        check_fragments(self.state.config.fragments, len(named), "a model")  # an optimizer's: at its first exchange
        self.state.bind(named, process_group=process_group, check_consistency=check_consistency, trainable_only=False)
        self._unbind()
        self._params = dict(named)
        self._names = {id(p): n for n, p in named}
        self._names.update((id(p), n) for n, p in aliases if n in self._params)

    def __getstate__(self) -> dict[str, Any]:
        unbound = object.__new__(type(self))
        unbound._unbind()
        return {**self.__dict__, **unbound.__dict__}

    @property
    def in_flight(self) -> tuple[InFlight, ...]:
        """The exchanges launched and not applied yet (``sync_delay``), oldest first."""
        return tuple(self._in_flight)

    @property
    def steps(self) -> int:
        """Optimizer steps taken; under a commit, the replica groups' count (a healing group takes a healthy one's),
        so a Fabric loop ``while update.steps < max_steps`` ends with the others."""
        return self.commit.steps if self.commit is not None else self.state.optimizer_step

    def close(self) -> None:
        """Leave the replica groups of the commit, if any (torchft's servers end)."""
        if self.commit is not None:
            self.commit.close()

    @property
    def active(self) -> bool:
        """Whether there is anything to exchange (more than one process, or other groups to commit with)."""
        return self.commit is not None or self.state.world_size > 1

    def name_of(self, param: Tensor) -> str | None:
        """The name ``param`` (a parameter, or an alias of one) is exchanged under; None: not exchanged."""
        return self._names.get(id(param))

    def _names_of(self, params: Iterable[Tensor] | None) -> list[str]:
        if params is None:
            return list(self._params)
        return [n for n in map(self._names.get, map(id, params)) if n is not None]

    @torch.no_grad()
    def hold_local(self, params: Iterable[Tensor] | None = None) -> None:
        """Put this rank's view ``global + e`` of ``params`` (default: all) in the module, before its forward."""
        if self.commit is not None:
            self.commit.before_step()
        if self.nonfinite.stop is not None:  # max_nonfinite_steps consecutive non-finite exchanges: here
            raise self.nonfinite.stop
        if not self.active or self._timed_dense():
            return  # nothing to exchange, or a plain DDP step (the module holds the replicas, the same everywhere)
        names = [n for n in self._names_of(params) if n not in self._local]
        if not names:
            return  # the module holds the view already (the optimizer step's, after the forward's)
        held, offload = self.state.memory.held(names), self.offload  # the residuals at once: no call a tensor
        views: list[Tensor] = []
        residuals: list[Tensor] = []
        shaped: list[str] = []  # their names
        for name in names:
            p = self._params[name]
            g = self._global.get(name)
            if g is None or g.shape != p.shape or g.dtype != p.dtype or g.device != (CPU if offload else p.device):
                home, pin = self._place(p)  # (the device above is its home, inline: no call a tensor)
                self._global[name] = g = torch.empty(p.shape, dtype=p.dtype, device=home, pin_memory=pin)
                self._synced.pop(name, None)
            if self._synced.get(name) != p._version:  # written since (a checkpoint restore): the global value now
                g.copy_(p)
            e = held.get(name)
            if e is not None and e.device == p.device:
                views.append(p)
                residuals.append(e)
                shaped.append(name)
            elif e is not None:
                p.add_(e.view_as(p).to(p.device))  # offloaded: a copy on the device
            self._local.add(name)
        if views:  # one operator, not one per tensor
            torch._foreach_add_(views, self._shaped_residuals.of(shaped, residuals, views))

    @torch.no_grad()
    def hold_global(self, params: Iterable[Tensor] | None = None) -> None:
        """Put the global values of ``params`` back in the module, the view's progress folded into ``e`` first."""
        if self._in_flight:
            self.land_due()  # the exchanges in flight arrive first (every rank is here together)
        names = [n for n in self._names_of(params) if n in self._local]
        memory = self.state.memory
        for name in names:
            delta = progress(self._params[name], self._global[name], memory.get(name) if name in memory else None)
            if not all_finite(delta):
                delta.zero_()
                self.nonfinite.found(name)
            if delta.any():  # a backward without a step, or nothing stepped yet: nothing to fold
                memory.accumulate(name, delta)
                memory.unstage([name])
        self._hold_global(names)
        if self.nonfinite.pending:  # found in the fold: healed now, before the next step
            self._heal()

    def step(self, optimizer_step: Callable[[], _T], optimizer: Any) -> _T:
        """Run ``optimizer_step`` (a step of ``optimizer``) on this rank's view, then the exchange; its output."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.hold_local(params)
        self.stepping = True
        try:
            output = optimizer_step()
        finally:
            self.stepping = False
        self.exchange(params)
        return output

    @torch.no_grad()
    def exchange(self, params: Iterable[Tensor] | None = None) -> None:
        """After an optimizer step on ``params``: send, average, keep the rest (every rank at the same point)."""
        if self.commit is not None:
            return self.commit.run_exchange(lambda: self._exchange(params))
        self._exchange(params)

    def _exchange(self, params: Iterable[Tensor] | None) -> None:
        if not self.active:
            return
        state = self.state
        names = [n for n in self._names_of(params) if n in self._local]
        if state.plain_ddp or not names:
            state.mark_end()
            return
        if state.skips is not None and state.skips.overflowed:  # every rank's fp16 scaler skipped it: nothing moves
            if state.config.sync_every == 1:
                self._hold_global(names)
            state.end_unexchanged()
            state.mark_end()
            return
        memory = state.memory
        group = tuple(names)
        self.land_due(group)  # exchanges launched sync_delay steps ago arrive
        fragments = self._fragments.get(group)
        if fragments is None:
            fragments = self._fragments[group] = fragments_of(names, self._params, state.config)
        launch: list[Bucket] = []
        for fragment in fragments:
            sync = fragment.tick(state.cycle, state.config.sync_every, self.due_now)
            for bucket in fragment.buckets_of(self._params, self._global, self.bucket_bytes, self._place):
                if sync:
                    launch.append(bucket)
                else:
                    count_local(state, bucket)
        if not launch:
            state.end_unexchanged()
            return
        delay = state.config.sync_delay
        launches: list[Rounds[Future[Average]]] = []
        with state.wire.comm.coalescing():  # one collective per kind and round: buckets bound buffers only
            for together in [[b] for b in launch] if self.offload else [launch]:  # offloaded: staged one at a time
                plans = [state.plan(bucket.delta, bucket.params) for bucket in together]
                prepared = [bucket_parts(b, p, memory, state.wire) for b, p in zip(together, plans, strict=True)]
                drop_nonfinite([part for parts, _ in prepared for part in parts], self.nonfinite.found)
                if state.config.error_feedback_decay != 1.0 and not self.due_now:  # not in a hand-over
                    decay_residuals(memory, together, state.config.error_feedback_decay)
                for bucket, plan, (parts, flat) in zip(together, plans, prepared, strict=True):
                    if delay:  # u = e + delta, handed over (the view keeps it meanwhile)
                        bucket.hand_over(parts, flat)
                    launches.append(bucket_rounds(state, bucket.delta, plan, last=False, inputs_finite=True))
            futures = run_together(launches)
            state.close()
        if delay:
            self._in_flight.append(InFlight(group, launch, futures, delay))
            self._heal()
            return
        for bucket, future in zip(launch, futures, strict=True):
            self._apply_average(bucket, self._wait(future))
            memory.unstage(bucket.names)  # offloaded residuals go back to the CPU
            torch._foreach_copy_(bucket.params, bucket.views)  # the global values back in the module
            for name, p in zip(bucket.names, bucket.params, strict=True):
                self._synced[name] = p._version
                self._local.discard(name)
        self._heal()
        state.mark_end()

    def _wait(self, future: Future[Average]) -> Any:
        waited = time.perf_counter()
        average = future.wait()
        self.state.telemetry.wait_seconds += time.perf_counter() - waited
        return average

    def _apply_average(self, bucket: Bucket, average: Any) -> None:
        if self.offload:  # applied on the device, as without offloading, then copied back
            average = StagedAverage(average, bucket.delta.device)
        if self.due_now:  # the hand-over's exchanges (flush_in_rounds)
            self.outer_step.hand_over(average, bucket.glob)
        else:
            self.outer_step.apply(average, bucket.glob, tuple(bucket.names))

    @torch.no_grad()
    def land_due(self, group: tuple[str, ...] | None = None) -> None:
        """The exchanges in flight of ``group`` that are due arrive (None: all; every rank at the same point)."""
        keep: list[InFlight] = []
        for flight in self._in_flight:
            if group is not None:
                if flight.group != group:
                    keep.append(flight)
                    continue
                flight.left -= 1
                if flight.left > 0:
                    keep.append(flight)
                    continue
            if self.commit is None or self.commit.commits_flight(flight):
                for bucket, future in zip(flight.buckets, flight.futures, strict=True):
                    bucket.land(self._wait(future), self.state, self._apply_average)
        self._in_flight = keep

    def _timed_dense(self) -> bool:
        """Whether this is a timed fallback's plain DDP step (opened here); entering them flushes the residuals."""
        state, timed = self.state, self.state.timed_fallback
        if not state.times_whole_steps or timed is None:
            return False
        if state.in_step:
            return state.plain_ddp
        state.begin()
        dense = timed.kind(state.step) in (DENSE, TRIAL_DENSE)
        entering, state.plain_ddp = dense and not state.plain_ddp, dense
        if entering:
            self.flush_residuals()
            if self.on_dense is not None:
                self.on_dense()
        return dense

    @torch.no_grad()
    def flush_residuals(self, rounds: int | None = None) -> None:
        """Add the mean of the processes' residuals to the global model, and empty them (``rounds``: in rounds)."""
        if self.commit is not None:
            self.commit.run_flush(rounds, self._flush_exactly)
        elif not self.active:
            return
        elif rounds is not None:
            flush_in_rounds(self, rounds)
        else:
            self._flush_exactly()

    def _flush_exactly(self) -> None:
        self.hold_global()
        flush_exactly(self.state, self._params)
        self._synced.clear()

    @property
    def nonfinite_updates(self) -> int:
        """Tensor updates this rank dropped as non-finite."""
        return self.nonfinite.updates

    def _heal(self) -> None:
        """Parameters whose update was dropped go back to their global values; ``on_nonfinite`` resets them."""
        nonfinite = self.nonfinite
        if not (nonfinite.pending or nonfinite.streak):
            return  # nothing dropped, now or at the last exchange
        names = nonfinite.settle(self.state.rank, self.state.optimizer_step, self.state.config.max_nonfinite_steps)
        if names:
            self._hold_global([n for n in names if n in self._local])
            if self.on_nonfinite is not None:
                self.on_nonfinite(names)
