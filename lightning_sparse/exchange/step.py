"""One bucket of one optimizer step exchanged with a rank's :class:`~lightning_sparse.exchange.state.SparseState`.

Compression is per parameter (``k = round(density * numel)``, at least 1): results do not depend on the buckets.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from lightning_sparse._utils import all_finite
from lightning_sparse.exchange.fallback import DENSE, SPARSE, TRIAL_DENSE
from lightning_sparse.exchange.state import SparseState
from lightning_sparse.wire import DENSE as DENSE_PATTERN
from lightning_sparse.wire import (
    GATHER,
    PATTERNS,
    Average,
    BucketCall,
    BucketPlan,
    Member,
    Pending,
    bucket_wire_bytes,
    count_dense,
    sparse_pays,
)
from lightning_sparse.wire.comm import CollectiveError, Rounds, completed, first_line, run
from lightning_sparse.wire.stats import Counters

__all__ = ["bucket", "bucket_rounds", "keep_gradient", "sparse_is_cheaper"]


def keep_gradient(state: SparseState, buffer: Tensor, last: bool) -> Future[Tensor]:
    """Update mode: keep the gradient ``buffer``; under fp16 AMP agree after the last on an overflow anywhere."""
    if state.skips is None:
        return completed(buffer)
    counters = Counters()
    where = f"the overflow check of optimizer step {state.optimizer_step}"
    future = state.skips.agree(state.wire.comm, buffer, last, counters, functools.partial(state.error, where))
    if last:
        state.telemetry.record("overflow check", counters, "overflow check")
    return future


def bucket(
    state: SparseState, buffer: Tensor, plan: BucketPlan, *, last: bool = True, inputs_finite: bool = False
) -> Future[Average]:
    """Exchange one bucket of ``state``'s step: a future of its average (``inputs_finite``: skip the check)."""
    return run(bucket_rounds(state, buffer, plan, last=last, inputs_finite=inputs_finite))


def bucket_rounds(
    state: SparseState, buffer: Tensor, plan: BucketPlan, *, last: bool = True, inputs_finite: bool = False
) -> Rounds[Future[Average]]:
    """:func:`bucket` in rounds, for buckets driven together (``run_together``, then ``state.close()``)."""
    spent = 0.0  # this bucket's own time: the others' work between its rounds is theirs
    start = time.perf_counter()
    if not state.in_step:
        state.begin()
    config, ctx, schedule = state.config, state.wire, state.schedule
    counters = Counters(numel=buffer.numel(), buckets=1)
    count_dense(counters, state.world_size, buffer.numel() * buffer.element_size())
    observe = schedule.observe if schedule.observes else None
    call = BucketCall(buffer, plan, state.step, counters, inputs_finite=inputs_finite, observe=observe)
    if state.skips is not None and config.compress == "gradient":  # restored if the scaler skips the step
        state.skips.keep(state.memory, state.velocity, [m.name for m in plan.members])
    if config.momentum_correction:
        _apply_local_momentum(state, call)
    sparse = plan.sparse_members
    ks: list[int] | None = None  # the counts of a bucket sent sparse
    method = "dense (warm-up)" if sparse else "dense (small tensors)"  # for telemetry
    timed = state.timed_fallback
    past_warmup = state.step >= config.warmup_steps
    if sparse and past_warmup:
        density = schedule.constant
        route = _route(state, buffer, plan, schedule.density(state.step) if density is None else density)
        kind = timed.kind(state.step) if timed is not None else SPARSE
        if kind == TRIAL_DENSE:
            method = "dense (timing trial)"
        elif kind == DENSE:
            counters.fallback_buckets = 1
            method = "dense (timed fallback)"
        elif config.byte_rule and not route.cheaper:
            counters.fallback_buckets = 1
            method = "dense (fallback)"
        else:
            ks, method = route.ks, route.method
    where = f"the exchange of {plan.label} ({method}) at optimizer step {state.optimizer_step}"
    if state.optimizer_step != state.step:
        where += f" (exchange {state.step})"
    try:
        if ks is not None:
            rounds = PATTERNS[ctx.compressor.pattern].launch_rounds(ctx, call, ks)
            while True:
                try:
                    next(rounds)
                except StopIteration as stop:
                    sparse_part = stop.value
                    break
                spent += time.perf_counter() - start
                yield
                start = time.perf_counter()
            parts = [sparse_part, DENSE_PATTERN.launch_members(ctx, call, plan.dense_members)]
        elif not sparse and config.value_bits is not None and config.compress == "update" and past_warmup:
            counters.dense_buckets = 1
            parts = [DENSE_PATTERN.launch_members(ctx, call, plan.dense_members)]
        else:
            counters.dense_buckets = 1
            parts = [DENSE_PATTERN.launch(ctx, call)]
    except CollectiveError as error:  # waited for on this thread (split, sketch)
        raise state.error(where, error.what, error.cause) from error
    future = _average(state, buffer, parts, where)
    if timed is not None:
        future = timed.track(future)
    counters.compress_seconds = spent + time.perf_counter() - start
    state.telemetry.record(plan.label, counters, method)
    if last:
        state.close()
    return future


def sparse_is_cheaper(state: SparseState, buffer: Tensor, sparse: tuple[Member, ...], ks: list[int]) -> bool:
    """The byte rule: whether sparse moves fewer (ring-model) bytes than dense for the ``sparse`` members."""
    numels = [m.numel for m in sparse]
    wire = bucket_wire_bytes(state.wire, ks, numels, state.wire.vdtype(buffer).itemsize, world=state.world_size)
    return sparse_pays(wire, state.world_size, sum(numels) * buffer.element_size())


@dataclass(frozen=True)
class Route:
    """How a bucket's sparse members cross the wire at one density, from sizes and settings only."""

    ks: list[int]  # the coordinates sent of each sparse member
    cheaper: bool  # whether that moves fewer bytes than sending them dense (True where the byte rule is off)
    method: str  # the compressor's name, and " (split)" where the split exchange carries it


def _route(state: SparseState, buffer: Tensor, plan: BucketPlan, density: float) -> Route:
    """The bucket's :class:`Route` at ``density`` (made once per plan, density, dtype and group size)."""
    key = (plan, density, buffer.dtype, state.world_size)
    routes = state.routes
    route = routes.get(key) if type(density) is float else None  # a schedule's own number type: each time
    if route is None:
        ctx, sparse = state.wire, plan.sparse_members
        ks = ctx.compressor.ks_for(plan.sparse_numels, density)
        method = ctx.compressor.name or type(ctx.compressor).__name__
        if ctx.compressor.pattern == "gather":
            vbytes = ctx.vdtype(buffer).itemsize
            if GATHER.exchange_for(ctx, ks, [m.numel for m in sparse], vbytes) == "split":
                method += " (split)"  # what exchange="auto" picked
        route = Route(ks, not state.config.byte_rule or sparse_is_cheaper(state, buffer, sparse, ks), method)
        if type(density) is float:
            if len(routes) >= 4096:  # a schedule of ever new densities: the oldest go
                routes.clear()
            routes[key] = route
    return route


def _average(state: SparseState, buffer: Tensor, parts: list[Pending], where: str) -> Future[Average]:
    """A future of the bucket's :class:`Average` (one that raises :class:`ExchangeError` if a collective failed)."""
    issued = [f for part in parts for f in part.futures]

    def finish(_: Any) -> Average:
        for f in issued:
            try:
                f.future.value()
            except Exception as error:
                return Average(buffer, parts, state.error(where, f.what, first_line(error)), parties=state.world_size)
        return Average(buffer, parts, waits=issued, parties=state.world_size)

    if not issued:
        return completed(finish(None))
    # collect_all even for one: then() on a CUDA future records its value's streams; Average.add_to waits itself
    return torch.futures.collect_all([f.future for f in issued]).then(finish)


def _apply_local_momentum(state: SparseState, call: BucketCall) -> None:
    """Momentum correction: each gradient becomes ``u = m*u + g``, in the bucket and (float32) ``call.sources``."""
    for m in call.plan.members:
        segment = call.segment(m)
        if not all_finite(segment):
            continue
        u = state.velocity.update(m.name, segment, state.config.momentum_correction)
        segment.copy_(u)
        call.sources[m.name] = u
