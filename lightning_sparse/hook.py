"""The DDP communication hook: bucket -> compress -> exchange -> average.

DDP calls :func:`sparse_comm_hook` once per gradient bucket per optimizer step, on the autograd
thread, as soon as the bucket's gradients are ready. The hook compresses each parameter of the
bucket (its gradient plus error-feedback residual), packs the whole bucket into one message,
launches the collective asynchronously and returns a future; DDP overlaps that with the rest of
backward and waits for it before the optimizer step. The future's callback writes the averaged
dense gradient back into the bucket.

Compression is per parameter (each sparse parameter sends ``k = round(density * numel)``
coordinates, at least 1), so results do not depend on how DDP groups parameters into buckets;
communication is per bucket. Parameters below ``min_numel`` go dense, in the same step.

:func:`exchange` decides, per bucket, between the dense all-reduce and the sparse exchange, runs
the step's bookkeeping and returns the :class:`~lightning_sparse.wire.Average` of what the ranks
sent; where the average lands is the caller's: the gradient hook writes it into the bucket, the
update exchange hands it to an outer step (:mod:`lightning_sparse.outer`). How a compressor's
choice crosses the wire is :mod:`lightning_sparse.wire`.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime
# (``bucket`` must be annotated with the class dist.GradBucket itself, not a string).

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse._utils import all_finite
from lightning_sparse.fallback import DENSE, SPARSE, TRIAL_DENSE
from lightning_sparse.schedules import k_for
from lightning_sparse.state import SparseState
from lightning_sparse.stats import Counters
from lightning_sparse.wire import DENSE as DENSE_PATTERN
from lightning_sparse.wire import (
    GATHER,
    PATTERNS,
    Average,
    BucketCall,
    Member,
    Pending,
    bucket_wire_bytes,
    count_all_gather,
    count_all_reduce,
    count_dense,
    sparse_pays,
)
from lightning_sparse.wire.comm import CollectiveError, first_line

__all__ = [
    "begin_step",
    "communicate",
    "exchange",
    "k_for",
    "local_gradient_hook",
    "sparse_comm_hook",
    "sparse_is_cheaper",
    "update_comm_hook",
]


def sparse_comm_hook(state: SparseState, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook (``ddp_model.register_comm_hook(state, sparse_comm_hook)``)."""
    return communicate(state, bucket.buffer(), bucket.parameters(), is_last=bucket.is_last())


def local_gradient_hook(state: Any, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook that keeps this rank's own gradient and sends nothing."""
    return _done(bucket.buffer())


def update_comm_hook(state: SparseState, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook of update mode: keep this rank's own gradient, send nothing (the
    exchange happens after the optimizer step, see :mod:`lightning_sparse.update`); on the steps a
    timed fallback sends dense (``state.ddp_mode``), all-reduce the gradient as plain DDP does."""
    if state.ddp_mode:
        return sparse_comm_hook(state, bucket)
    if state.skips is not None:  # fp16 AMP: every rank skips a step that overflowed on one
        counters = Counters()
        where = f"the overflow check of optimizer step {state.step}"
        future = state.skips.agree(
            state.wire.comm,
            bucket.buffer(),
            bucket.is_last(),
            counters,
            lambda what, cause: ExchangeError(state, where, what, cause),
        )
        if bucket.is_last():
            state.telemetry.record("overflow check", counters, "overflow check")
        return future
    return _done(bucket.buffer())


def communicate(state: SparseState, buffer: Tensor, params: list[Tensor], is_last: bool = True) -> Future[Tensor]:
    """Exchange one bucket: the body of the hook, callable on plain tensors (tests, benchmarks).

    ``buffer`` is the flat sum-ready local gradient of ``params`` (in their order); the returned
    future holds ``buffer`` overwritten with the average over ranks of what each rank sent.
    """
    return exchange(state, buffer, params, is_last).then(lambda fut: fut.value().as_dense())


def exchange(
    state: SparseState, buffer: Tensor, params: list[Tensor], is_last: bool = True, inputs_finite: bool = False
) -> Future[Average]:
    """Exchange one bucket and return (a future of) the average of what the ranks sent.

    ``inputs_finite``: the caller made every input finite (the update exchange drops a
    non-finite update on its rank), so the patterns skip their own per-tensor check.
    """
    start = time.perf_counter()
    if not state.in_step:
        begin_step(state)
    plan = state.plan(buffer, params)
    counters = Counters(numel=buffer.numel(), buckets=1)
    count_dense(counters, state.world_size, buffer.numel() * buffer.element_size())
    call = BucketCall(
        buffer,
        plan,
        state.step,
        counters,
        inputs_finite=inputs_finite,
        observe=state.schedule.observe if state.schedule.observes else None,
    )
    if state.skips is not None and state.compress == "gradient":
        # fp16 AMP: what the exchange takes from the residuals comes back if the scaler skips the step
        state.skips.keep(state.memory, state.velocity, [m.name for m in plan.members])
    if state.momentum_correction:
        _apply_local_momentum(state, call)
    sparse = plan.sparse_members
    ks: list[int] = []
    send_sparse = False
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
        elif state.fallback_to_dense and not sparse_is_cheaper(state, buffer, sparse, ks):
            counters.fallback_buckets = 1
            method = "dense (fallback)"
        else:
            send_sparse = True
            method = state.compressor.name or type(state.compressor).__name__
            if _exchange_of(state, buffer, sparse, ks) == "split":
                method += " (split)"  # what exchange="auto" picked shows in the telemetry's rows
    ctx = state.wire
    where = f"the exchange of {plan.label} ({method}) at optimizer step {state.step}"
    try:
        if send_sparse:
            parts = [
                PATTERNS[state.compressor.pattern].launch(ctx, call, ks),
                DENSE_PATTERN.launch_members(ctx, call, plan.dense_members),
            ]
        else:
            counters.dense_buckets = 1
            parts = [DENSE_PATTERN.launch(ctx, call)]
    except CollectiveError as error:  # a collective waited for on this thread (split, sketch)
        raise ExchangeError(state, where, error.what, error.cause) from error
    future = _average(state, buffer, parts, where)
    if timed is not None:
        future = timed.track(future)
    counters.compress_seconds = time.perf_counter() - start
    state.telemetry.record(plan.label, counters, method)
    if is_last:
        _end_step(state)
    return future


class ExchangeError(RuntimeError):
    """A collective of the sparse exchange failed or timed out: the message says where (the bucket,
    the way it was sent, the optimizer step, the collective, the rank) and what to check."""

    def __init__(self, state: SparseState, where: str, what: str, cause: str) -> None:
        super().__init__(
            f"lightning_sparse: rank {state.rank} of {state.world_size} ({state.compress} mode): {where} failed in "
            f"its {what}: {cause}. Another rank did not take part in time: one may have stopped, crashed or be "
            "stalled (look at its log for an earlier error and at the last step it reached), or the process "
            "group's timeout is too short for this link (SparseDDPStrategy(timeout=datetime.timedelta(...)); "
            "Lightning's default is 30 minutes)."
        )


def _average(state: SparseState, buffer: Tensor, parts: list[Pending], where: str) -> Future[Average]:
    """A future of the bucket's :class:`Average`, once every collective of its parts completed (an
    Average that raises :class:`ExchangeError` when used, if one failed)."""
    issued = [f for part in parts for f in part.futures]

    def finish(_: Any) -> Average:
        for f in issued:
            try:
                f.future.value()
            except Exception as error:
                return Average(buffer, parts, ExchangeError(state, where, f.what, first_line(error)))
        return Average(buffer, parts)

    if not issued:
        return _done(finish(None))
    if len(issued) == 1:
        return issued[0].future.then(finish)
    return torch.futures.collect_all([f.future for f in issued]).then(finish)


def _apply_local_momentum(state: SparseState, call: BucketCall) -> None:
    """Momentum correction: each member's gradient becomes its local momentum ``u = m*u + g``.

    ``u`` is written into the bucket (what a dense send then sends: averaging momenta is the
    momentum of the average) and kept in float32 in ``call.sources`` for the sparse paths, so no
    precision is lost to the bucket's dtype there. Non-finite gradients are left as they are.
    """
    for m in call.plan.members:
        segment = call.segment(m)
        if not all_finite(segment):
            continue
        u = state.velocity.update(m.name, segment, state.momentum_correction)
        segment.copy_(u)
        call.sources[m.name] = u


def begin_step(state: SparseState) -> None:
    """Once per optimizer step, before its first bucket (or, in update mode with a timed fallback,
    before its forward: the way the step sends must be known then)."""
    state.in_step = True
    if state.skips is not None:
        state.skips.begin()
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


def sparse_is_cheaper(state: SparseState, buffer: Tensor, sparse: tuple[Member, ...], ks: list[int]) -> bool:
    """The byte rule for a bucket: ring-model wire bytes of the sparse exchange of its ``sparse``
    members vs a dense all-reduce of them (:func:`~lightning_sparse.wire.sparse_pays`).

    The dense parts of the bucket cost the same either way and are left out. World size 1 moves
    nothing either way: dense is then exact and free.
    """
    vbytes = state.wire.vdtype(buffer).itemsize
    numels = [m.numel for m in sparse]
    wire = bucket_wire_bytes(state.wire, ks, numels, vbytes, world=state.world_size)
    return sparse_pays(wire, state.world_size, sum(numels) * buffer.element_size())


def _exchange_of(state: SparseState, buffer: Tensor, sparse: tuple[Member, ...], ks: list[int]) -> str | None:
    """The exchange a gather-pattern bucket takes (None for the other patterns)."""
    if state.compressor.pattern != "gather":
        return None
    return GATHER.exchange_for(state.wire, ks, [m.numel for m in sparse], state.wire.vdtype(buffer).itemsize)


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut
