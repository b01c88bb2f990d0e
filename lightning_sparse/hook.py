"""The DDP communication hook: bucket -> compress -> exchange -> decompress -> average.

DDP calls :func:`sparse_comm_hook` once per gradient bucket per optimizer step, on the autograd
thread, as soon as the bucket's gradients are ready. The hook compresses each parameter of the
bucket (its gradient plus error-feedback residual), packs the whole bucket into one message,
launches the collective asynchronously and returns a future; DDP overlaps that with the rest of
backward and waits for it before the optimizer step. The future's callback writes the averaged
dense gradient back into the bucket.

Compression is per parameter (each sparse parameter sends ``k = round(density * numel)``
coordinates, at least 1), so results do not depend on how DDP groups parameters into buckets;
communication is per bucket. Parameters below ``min_numel`` go dense, in the same step.

This module decides, per bucket, between the dense all-reduce and the sparse exchange, and runs
the step's bookkeeping; how a compressor's choice crosses the wire (messages, collectives, byte
models) is :mod:`lightning_sparse.patterns`.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime
# (``bucket`` must be annotated with the class dist.GradBucket itself, not a string).

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse import comm
from lightning_sparse._utils import all_finite
from lightning_sparse.fallback import DENSE, SPARSE, TRIAL_DENSE
from lightning_sparse.patterns import (
    PATTERNS,
    GatherPattern,
    _flush_residuals,
    _launch_dense_members,
    _value_dtype,
    count_all_gather,
    count_all_reduce,
    count_dense,
    ring_all_reduce_bytes,
)
from lightning_sparse.schedules import k_for
from lightning_sparse.state import BucketPlan, Member, SparseState
from lightning_sparse.stats import Counters


def sparse_comm_hook(state: SparseState, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook (``ddp_model.register_comm_hook(state, sparse_comm_hook)``)."""
    return communicate(state, bucket.buffer(), bucket.parameters(), is_last=bucket.is_last())


def local_gradient_hook(state: Any, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook of update mode: keep this rank's own gradient, send nothing
    (the exchange happens after the optimizer step, see :mod:`lightning_sparse.update`)."""
    return _done(bucket.buffer())


def communicate(
    state: SparseState,
    buffer: Tensor,
    params: list[Tensor],
    is_last: bool = True,
    accumulate_into: Tensor | None = None,
) -> Future[Tensor]:
    """Exchange one bucket: the body of the hook, callable on plain tensors (tests, benchmarks).

    ``buffer`` is the flat sum-ready local gradient of ``params`` (in their order); the returned
    future holds ``buffer`` overwritten with the average over ranks of what each rank sent. With
    ``accumulate_into`` (a flat tensor laid out like ``buffer``) the average is added into that
    tensor instead, touching only the coordinates that were sent (the update exchange adds it to
    the global parameters this way), and the future holds ``accumulate_into``.
    """
    start = time.perf_counter()
    if not state.in_step:
        _begin_step(state)
    plan = state.plan(buffer, params)
    counters = Counters(numel=buffer.numel(), buckets=1)
    count_dense(counters, state.world_size, buffer.numel() * buffer.element_size())
    if state.momentum_correction:
        _apply_local_momentum(state, buffer, plan)
    sparse = plan.sparse_members
    exchange: Callable[..., Future[Tensor]] | None = None
    ks: list[int] = []
    method = "dense (warm-up)" if sparse else "dense (small tensors)"  # how the bucket is sent, for telemetry
    timed = state.timed_fallback
    if sparse and state.step >= state.warmup_steps:
        density = state.schedule.density(state.step)
        ks = [k_for(m.numel, density) for m in sparse]
        kind = timed.kind(state.step) if timed is not None else SPARSE
        if kind == TRIAL_DENSE:
            method = "dense (timing trial)"
        elif kind == DENSE:
            counters.fallback_buckets = 1
            method = "dense (timed fallback)"
        elif state.fallback_to_dense and not _sparse_is_cheaper(state, buffer, sparse, ks):
            counters.fallback_buckets = 1
            method = "dense (fallback)"
        else:
            exchange = _sparse_exchange
            method = state.compressor.name or type(state.compressor).__name__
            if _exchange_of(state, buffer, sparse, ks) == "split":
                method += " (split)"  # what exchange="auto" picked shows in the telemetry's rows
    if exchange is None:
        counters.dense_buckets = 1
        future = _dense_exchange(state, buffer, plan, counters, accumulate_into)
    else:
        future = exchange(state, buffer, plan, ks, counters, accumulate_into)
    if timed is not None:
        future = timed.track(future)
    state.sources = {}
    counters.compress_seconds = time.perf_counter() - start
    state.telemetry.record(plan.label, counters, method)
    if is_last:
        _end_step(state)
    return future


def _apply_local_momentum(state: SparseState, buffer: Tensor, plan: BucketPlan) -> None:
    """Momentum correction: each member's gradient becomes its local momentum ``u = m*u + g``.

    ``u`` is written into the bucket (what a dense send then sends: averaging momenta is the
    momentum of the average) and kept in float32 in ``state.sources`` for the sparse paths, so no
    precision is lost to the bucket's dtype there. Non-finite gradients are left as they are.
    """
    for m in plan.members:
        segment = buffer[m.offset : m.offset + m.numel]
        if not all_finite(segment):
            continue
        u = state.velocity.update(m.name, segment, state.momentum_correction)
        segment.copy_(u)
        state.sources[m.name] = u


def _begin_step(state: SparseState) -> None:
    """Once per optimizer step, before its first bucket."""
    state.in_step = True
    if state.loss_scale is not None:
        # With a gradient scaler the gradients (and so the residuals) carry the loss scale. When the
        # scaler changes it (halved after an overflow, doubled after a run of good steps), bring the
        # residuals to the new scale so they keep their weight; the ratio is a power of 2: exact.
        scale = float(state.loss_scale())
        last = state.last_loss_scale
        if last is not None and scale != last and last > 0:
            state.memory.scale_(scale / last)
            state.velocity.scale_(scale / last)
        state.last_loss_scale = scale
    if state.timed_fallback is not None:
        # may agree on a trial's outcome (one small collective, issued here, before this step's
        # first bucket, at the same step on every rank)
        sent = state.timed_fallback.begin_step(state.step)
        if sent:  # the decision is one all-reduce
            counters = Counters()
            count_all_reduce(counters, state.world_size, sent)
            state.telemetry.record("timed fallback", counters, "timed fallback")


def _end_step(state: SparseState) -> None:
    state.in_step = False
    interval = state.residual_norm_interval
    if state.error_feedback and interval > 0 and state.step % interval == 0:
        state.telemetry.residual_norm = state.memory.norm_sq() ** 0.5
        state.telemetry.residual_norm_step = state.step
    # on the hook's thread, after the step's collectives; an adaptive density gathers its statistics
    schedule_bytes = state.schedule.end_step(state.step)
    if schedule_bytes:  # the statistics are all-gathered (DensitySchedule.end_step)
        counters = Counters()
        count_all_gather(counters, state.world_size, schedule_bytes)
        state.telemetry.record("density schedule", counters, "density schedule")
    state.telemetry.end_step()
    state.step += 1


def _sparse_is_cheaper(state: SparseState, buffer: Tensor, sparse: tuple[Member, ...], ks: list[int]) -> bool:
    """Ring-model wire bytes of the sparse exchange vs a dense all-reduce of the same tensors.

    A ring all-gather moves (W-1)*m bytes through each rank for an m-byte message; a ring
    all-reduce of n bytes moves 2*(W-1)/W*n. The dense parts of the bucket cost the same either
    way and are left out. World size 1 moves nothing either way: dense is then exact and free.
    """
    world = state.world_size
    if world <= 1:
        return False
    vbytes = _value_dtype(state, buffer).itemsize
    dense_wire = ring_all_reduce_bytes(world, sum(m.numel for m in sparse) * buffer.element_size())
    pattern = PATTERNS[state.compressor.pattern]
    numels = [m.numel for m in sparse]
    wire = pattern.wire_bytes(world, ks, vbytes, numels, state.compressor, state.exchange, state.compact_indices)
    return wire < dense_wire


def _exchange_of(state: SparseState, buffer: Tensor, sparse: tuple[Member, ...], ks: list[int]) -> str | None:
    """The exchange a gather-pattern bucket takes (None for the other patterns)."""
    pattern = PATTERNS[state.compressor.pattern]
    if not isinstance(pattern, GatherPattern):
        return None
    vbytes = _value_dtype(state, buffer).itemsize
    numels = [m.numel for m in sparse]
    return pattern.choose(state.world_size, ks, vbytes, numels, state.exchange, state.compact_indices)[0]


def _done(value: Tensor) -> Future[Tensor]:
    fut: Future[Tensor] = Future()
    fut.set_result(value)
    return fut


# --------------------------------------------------------------------------- dense
def _dense_exchange(
    state: SparseState, buffer: Tensor, plan: BucketPlan, counters: Counters, accumulate_into: Tensor | None = None
) -> Future[Tensor]:
    _flush_residuals(state, buffer, plan.members, counters)
    if state.schedule.observes:  # the bucket now holds p = g + e: an adaptive density learns from dense steps too
        for m in plan.sparse_members:
            state.schedule.observe(state.step, plan.label, m.name, buffer[m.offset : m.offset + m.numel])
    world = state.world_size
    count_all_reduce(counters, world, buffer.numel() * buffer.element_size())
    counters.sent_numel += buffer.numel()

    def average(summed: Tensor) -> Tensor:
        summed.div_(world)
        return summed if accumulate_into is None else accumulate_into.add_(summed)

    if world == 1:
        return _done(average(buffer))
    return comm.all_reduce(buffer, state.process_group).then(lambda fut: average(fut.value()[0]))


# --------------------------------------------------------------------------- sparse
def _sparse_exchange(
    state: SparseState,
    buffer: Tensor,
    plan: BucketPlan,
    ks: list[int],
    counters: Counters,
    accumulate_into: Tensor | None = None,
) -> Future[Tensor]:
    parts = [
        PATTERNS[state.compressor.pattern].launch(state, buffer, plan, ks, counters),
        _launch_dense_members(state, buffer, plan, counters),
    ]
    futures = [f for part in parts for f in part.futures]

    def finish(_: Any) -> Tensor:
        for f in futures:
            f.value()  # re-raises a failed collective
        out = accumulate_into
        if out is None:
            out = buffer.zero_()
        for part in parts:
            part.apply(out)
        return out

    if not futures:
        return _done(finish(None))
    return torch.futures.collect_all(futures).then(finish)
