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
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime
# (``bucket`` must be annotated with the class dist.GradBucket itself, not a string).

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse import comm
from lightning_sparse._utils import scratch
from lightning_sparse.compressors import CompressContext
from lightning_sparse.fallback import DENSE, SPARSE, TRIAL_DENSE
from lightning_sparse.state import BucketPlan, Member, SparseState
from lightning_sparse.stats import Counters

_INDEX_BYTES = 4  # indices travel as int32 (bucket offsets); buckets are far below 2**31 elements


def sparse_comm_hook(state: SparseState, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook (``ddp_model.register_comm_hook(state, sparse_comm_hook)``)."""
    return communicate(state, bucket.buffer(), bucket.parameters(), is_last=bucket.is_last())


def local_gradient_hook(state: Any, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook of update mode: keep this rank's own gradient, send nothing
    (the exchange happens after the optimizer step, see :mod:`lightning_sparse.update`)."""
    return _done(bucket.buffer())


def k_for(numel: int, density: float) -> int:
    """Number of coordinates sent for a tensor of ``numel`` elements at ``density`` (>= 1)."""
    return max(1, min(numel, round(density * numel)))


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
    counters = Counters(dense_bytes=buffer.numel() * buffer.element_size(), numel=buffer.numel(), buckets=1)
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


def gradient_of(state: SparseState, buffer: Tensor, m: Member) -> Tensor:
    """What the hook compresses for member ``m``: its gradient, or its local momentum (float32)."""
    source = state.sources.get(m.name)
    return source if source is not None else buffer[m.offset : m.offset + m.numel]


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
        if sent:
            state.telemetry.record("timed fallback", Counters(sent_bytes=sent), "timed fallback")


def _end_step(state: SparseState) -> None:
    state.in_step = False
    interval = state.residual_norm_interval
    if state.error_feedback and interval > 0 and state.step % interval == 0:
        state.telemetry.residual_norm = state.memory.norm_sq() ** 0.5
        state.telemetry.residual_norm_step = state.step
    # on the hook's thread, after the step's collectives; an adaptive density gathers its statistics
    schedule_bytes = state.schedule.end_step(state.step)
    if schedule_bytes:
        state.telemetry.record("density schedule", Counters(sent_bytes=schedule_bytes), "density schedule")
    state.telemetry.end_step()
    state.step += 1


def _value_dtype(state: SparseState, buffer: Tensor) -> torch.dtype:
    return state.value_dtype or buffer.dtype


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
    return pattern.wire_bytes(world, ks, vbytes, [m.numel for m in sparse], state.compressor) < dense_wire


def ring_all_reduce_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-reduce of ``nbytes``."""
    return 2.0 * (world - 1) / world * nbytes


def ring_all_gather_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-gather of ``nbytes`` per rank."""
    return float((world - 1) * nbytes)


def _gather_message_bytes(k: int, vbytes: int) -> int:
    raw = k * (_INDEX_BYTES + vbytes)
    return (raw + 7) // 8 * 8  # every rank's chunk starts 8-byte aligned so its views are valid


def all_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite, in one read: the float32 sum is finite unless an
    entry is NaN/Inf (or, very rarely, finite entries overflow it: confirmed element-wise then)."""
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def _done(value: Tensor) -> Future[Tensor]:
    fut: Future[Tensor] = Future()
    fut.set_result(value)
    return fut


# --------------------------------------------------------------------------- dense
def _flush_residuals(state: SparseState, buffer: Tensor, members: tuple[Member, ...], counters: Counters) -> None:
    """Add any residual into the bucket before a dense send, so nothing stays behind unsent."""
    if not state.error_feedback:
        return
    for m in members:
        if m.name in state.memory:
            segment = buffer[m.offset : m.offset + m.numel]
            if not all_finite(segment):
                # Send the non-finite gradient as it is (every rank then sees a non-finite average
                # and the optimizer / gradient scaler skips the step); keep the residual unpoisoned.
                counters.nonfinite_buckets = 1
                continue
            state.memory.accumulate(m.name, segment)
            sent = state.memory.flush(m.name, buffer.dtype)
            assert sent is not None
            segment.copy_(sent)


def _dense_exchange(
    state: SparseState, buffer: Tensor, plan: BucketPlan, counters: Counters, accumulate_into: Tensor | None = None
) -> Future[Tensor]:
    _flush_residuals(state, buffer, plan.members, counters)
    if state.schedule.observes:  # the bucket now holds p = g + e: an adaptive density learns from dense steps too
        for m in plan.sparse_members:
            state.schedule.observe(state.step, plan.label, m.name, buffer[m.offset : m.offset + m.numel])
    counters.sent_bytes += buffer.numel() * buffer.element_size()
    counters.sent_numel += buffer.numel()
    world = state.world_size

    def average(summed: Tensor) -> Tensor:
        summed.div_(world)
        return summed if accumulate_into is None else accumulate_into.add_(summed)

    if world == 1:
        return _done(average(buffer))
    return comm.all_reduce(buffer, state.process_group).then(lambda fut: average(fut.value()[0]))


# --------------------------------------------------------------------------- sparse
@dataclass
class Pending:
    """A launched part of a bucket's exchange: its futures, and how to write its result back.

    ``apply(out)`` runs once every future of the bucket has completed, on a zeroed buffer (the
    gradient hook) or the global parameters (the update exchange); each part adds the averaged
    values of its own coordinates into ``out``.
    """

    futures: list[Future[Any]]
    apply: Callable[[Tensor], None]


class WirePattern:
    """How the coordinates chosen by a compressor cross the wire (one class per ``pattern``)."""

    def wire_bytes(self, world: int, ks: list[int], vbytes: int, numels: list[int], compressor: Any = None) -> float:
        """Bytes through each rank for the sparse members of a bucket (ring model)."""
        raise NotImplementedError

    def launch(
        self, state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters
    ) -> Pending:
        """Compress the bucket's sparse members, update their residuals, launch the collectives."""
        raise NotImplementedError


def compress_members(
    state: SparseState,
    buffer: Tensor,
    plan: BucketPlan,
    ks: list[int],
    values_out: Tensor,
    index_out: Tensor | None,
    counters: Counters,
) -> list[Tensor] | None:
    """Select ``ks`` coordinates of each sparse member, write their values (in ``values_out``'s
    dtype) and bucket offsets (into ``index_out``, if given), and keep the rest in the residual.

    Returns the per-member local indices when ``index_out`` is None (shared patterns keep them
    locally rather than sending them). A member whose gradient is not finite sends NaN and leaves
    its residual as it was; ``counters.nonfinite_buckets`` is then set.
    """
    compressor = state.compressor
    vdtype = values_out.dtype
    kept: list[Tensor] | None = None if index_out is not None else []
    pos = 0
    for m, k in zip(plan.sparse_members, ks, strict=True):
        g = gradient_of(state, buffer, m)
        ctx = CompressContext(step=state.step, key=m.key, rank=state.rank, world_size=state.world_size, seed=state.seed)
        if not all_finite(g):
            # Same message shape as always (the collectives must match on every rank), but NaN
            # values, so that the averaged gradient is non-finite on every rank and the step is
            # skipped everywhere alike; the residual keeps its previous value.
            counters.nonfinite_buckets = 1
            if compressor.pattern == "shared":
                idx = compressor.select(g, k, ctx)
            else:
                idx = torch.arange(k, device=g.device)
            values_out[pos : pos + k].fill_(float("nan"))
            _write_indices(idx, m, pos, k, index_out, kept)
            if state.schedule.observes:  # NaN statistics, but the same layout on every rank
                state.schedule.observe(state.step, plan.label, m.name, g)
            pos += k
            continue
        p = state.memory.accumulate(m.name, g) if state.error_feedback else g
        if state.schedule.observes:
            state.schedule.observe(state.step, plan.label, m.name, p)
        idx = compressor.select(p, k, ctx)
        if idx.numel() != k:
            raise RuntimeError(f"{type(compressor).__name__}.select returned {idx.numel()} indices for k={k}")
        values = p[idx]
        sent = _quantize(values, vdtype)
        if state.error_feedback:
            remainder = None if sent.dtype == values.dtype else values - sent.to(values.dtype)
            state.memory.keep_unsent(m.name, idx, remainder)
        if state.momentum_correction:
            state.velocity.mask(m.name, idx)
        values_out[pos : pos + k].copy_(sent)
        _write_indices(idx, m, pos, k, index_out, kept)
        pos += k
    return kept


def _quantize(values: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast values for the wire; float16 saturates at its largest finite value instead of
    overflowing to inf, so the part above it stays in the residual rather than poisoning it."""
    if dtype == values.dtype:
        return values
    if dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        values = values.clamp(-limit, limit)
    return values.to(dtype)


def _write_indices(
    idx: Tensor, m: Member, pos: int, k: int, index_out: Tensor | None, kept: list[Tensor] | None
) -> None:
    """Record a member's selected coordinates as bucket offsets: into the message, or kept locally."""
    if index_out is not None:
        index_out[pos : pos + k].copy_(idx)
        if m.offset:
            index_out[pos : pos + k].add_(m.offset)
    else:
        assert kept is not None
        kept.append(idx + m.offset if m.offset else idx)


class GatherPattern(WirePattern):
    """Each rank sends its own ``k`` (value, int32 index) pairs; all ranks all-gather them.

    Message layout per rank (one uint8 tensor, so one collective per bucket):
    ``[K int32 bucket offsets][K values][zero padding to 8 bytes]``, ``K = sum(ks)``.
    """

    def wire_bytes(self, world: int, ks: list[int], vbytes: int, numels: list[int], compressor: Any = None) -> float:
        return ring_all_gather_bytes(world, _gather_message_bytes(sum(ks), vbytes))

    def launch(
        self, state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters
    ) -> Pending:
        world = state.world_size
        vdtype = _value_dtype(state, buffer)
        vbytes = vdtype.itemsize
        total_k = sum(ks)
        message = torch.empty(_gather_message_bytes(total_k, vbytes), dtype=torch.uint8, device=buffer.device)
        index_out = message[: total_k * _INDEX_BYTES].view(torch.int32)
        values_out = message[total_k * _INDEX_BYTES : total_k * (_INDEX_BYTES + vbytes)].view(vdtype)
        message[total_k * (_INDEX_BYTES + vbytes) :].zero_()
        compress_members(state, buffer, plan, ks, values_out, index_out, counters)
        counters.sent_numel += total_k
        counters.sent_bytes += message.numel()
        if world > 1:
            gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=buffer.device)
            futures = [comm.all_gather(gathered, message, state.process_group)]
        else:
            gathered, futures = message, []

        def apply(out: Tensor) -> None:
            chunk = message.numel()
            for r in range(world):
                part = gathered[r * chunk : (r + 1) * chunk]
                idx_r = part[: total_k * _INDEX_BYTES].view(torch.int32)
                val_r = part[total_k * _INDEX_BYTES : total_k * (_INDEX_BYTES + vbytes)].view(vdtype)
                # Each rank's indices are unique, so every add lands on its own coordinate and the
                # sum over ranks happens in rank order: identical bits on every rank, CUDA included.
                out.index_add_(0, idx_r, val_r.to(out.dtype), alpha=1.0 / world)

        return Pending(futures, apply)


class SharedPattern(WirePattern):
    """Every rank picks the same coordinates (shared seed): only values are all-reduced."""

    def wire_bytes(self, world: int, ks: list[int], vbytes: int, numels: list[int], compressor: Any = None) -> float:
        return ring_all_reduce_bytes(world, sum(ks) * vbytes)

    def launch(
        self, state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters
    ) -> Pending:
        world = state.world_size
        message = torch.empty(sum(ks), dtype=_value_dtype(state, buffer), device=buffer.device)
        kept = compress_members(state, buffer, plan, ks, message, None, counters)
        assert kept is not None
        counters.sent_numel += message.numel()
        counters.sent_bytes += message.numel() * message.element_size()
        futures = [comm.all_reduce(message, state.process_group)] if world > 1 else []

        def apply(out: Tensor) -> None:
            out.index_add_(0, torch.cat(kept), message.to(out.dtype), alpha=1.0 / world)

        return Pending(futures, apply)


class SketchPattern(WirePattern):
    """Count-sketch (Sketched SGD): two all-reduces per bucket, both issued from the hook.

    Round 1 all-reduces the float32 ``rows x cols`` tables of all the bucket's sparse members
    (one message). Every rank then finds the same candidates from the summed tables
    (``compressor.candidates``), and round 2 all-reduces this rank's exact ``p`` at the
    candidates (in ``value_dtype``, one message). When round 2 completes, every rank keeps the
    ``k`` largest sums per member, writes their average into the bucket, and takes exactly what
    it contributed at those ``k`` coordinates out of its residual (the rounding error of
    ``value_dtype`` stays in).

    Ordering: round 1 is waited for here, on the hook's thread, and round 2 is issued right
    after it, before the hook returns. Every collective of every bucket is therefore issued by
    the same thread in the same order on every rank; issuing round 2 from a completion callback
    (a process-group thread) could interleave it differently with other buckets' collectives on
    each rank. The cost is that backward waits for one small all-reduce per bucket.
    """

    def wire_bytes(self, world: int, ks: list[int], vbytes: int, numels: list[int], compressor: Any = None) -> float:
        if compressor is None:
            raise ValueError("the sketch pattern's wire size depends on the compressor's settings: pass compressor")
        shapes = [compressor.table_shape(n, k) for n, k in zip(numels, ks, strict=True)]
        table_bytes = sum(r * c for r, c in shapes) * 4
        value_bytes = sum(compressor.num_candidates(n, k) for n, k in zip(numels, ks, strict=True)) * vbytes
        return ring_all_reduce_bytes(world, table_bytes) + ring_all_reduce_bytes(world, value_bytes)

    def launch(
        self, state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters
    ) -> Pending:
        compressor = state.compressor
        world = state.world_size
        vdtype = _value_dtype(state, buffer)
        members = plan.sparse_members
        shapes = [compressor.table_shape(m.numel, k) for m, k in zip(members, ks, strict=True)]
        # The tables live only until round 1 completes, inside this call: a reused buffer saves
        # the page faults of a fresh multi-MB allocation every step.
        tables = scratch("hook.sketch_tables", sum(r * c for r, c in shapes), torch.float32, buffer.device).zero_()
        ps: list[Tensor | None] = []
        ctxs: list[CompressContext] = []
        views: list[Tensor] = []
        pos = 0
        for m, k, (rows, cols) in zip(members, ks, shapes, strict=True):
            g = gradient_of(state, buffer, m)
            ctx = CompressContext(step=state.step, key=m.key, rank=state.rank, world_size=world, seed=state.seed)
            view = tables[pos : pos + rows * cols].view(rows, cols)
            p: Tensor | None = None
            if all_finite(g):
                p = state.memory.accumulate(m.name, g) if state.error_feedback else g
                compressor.sketch(p, k, ctx, view)
            else:
                # Sketch nothing (the summed tables stay finite, so every rank still finds the same
                # candidates), then send NaN in round 2: every rank gets a non-finite average and
                # skips the step alike; this rank's residual keeps its previous value.
                counters.nonfinite_buckets = 1
            if state.schedule.observes:  # as in compress_members: every rank observes every member
                state.schedule.observe(state.step, plan.label, m.name, p if p is not None else g)
            ps.append(p)
            ctxs.append(ctx)
            views.append(view)
            pos += rows * cols
        if world > 1:
            comm.all_reduce(tables, state.process_group).wait()  # round 1, on this thread (see above)
        cands = [
            compressor.candidates(view, m.numel, k, ctx)
            for view, m, k, ctx in zip(views, members, ks, ctxs, strict=True)
        ]
        values = torch.empty(sum(c.numel() for c in cands), dtype=vdtype, device=buffer.device)
        pos = 0
        for p, cand in zip(ps, cands, strict=True):
            if p is None:
                values[pos : pos + cand.numel()].fill_(float("nan"))
            else:
                values[pos : pos + cand.numel()].copy_(_quantize(p[cand], vdtype))
            pos += cand.numel()
        counters.sent_numel += sum(ks)
        counters.sent_bytes += tables.numel() * tables.element_size() + values.numel() * values.element_size()
        futures = [comm.all_reduce(values, state.process_group)] if world > 1 else []

        def apply(out: Tensor) -> None:
            start = 0
            for m, k, p, cand in zip(members, ks, ps, cands, strict=True):
                sums = values[start : start + cand.numel()]
                start += cand.numel()
                chosen = compressor.pick(sums, k)
                idx = cand[chosen]
                if state.error_feedback and p is not None:  # p: the residual buffer, untouched since launch
                    exact = p[idx]
                    sent = _quantize(exact, vdtype)
                    remainder = None if sent.dtype == exact.dtype else exact - sent.to(exact.dtype)
                    state.memory.keep_unsent(m.name, idx, remainder)
                if state.momentum_correction and p is not None:
                    state.velocity.mask(m.name, idx)
                out.index_add_(0, idx + m.offset, sums[chosen].to(out.dtype), alpha=1.0 / world)

        return Pending(futures, apply)


#: communication pattern name (``Compressor.pattern``) -> how it crosses the wire
PATTERNS: dict[str, WirePattern] = {"gather": GatherPattern(), "shared": SharedPattern(), "sketch": SketchPattern()}


def _launch_dense_members(state: SparseState, buffer: Tensor, plan: BucketPlan, counters: Counters) -> Pending:
    """All-reduce the bucket's small tensors (below ``min_numel``) as one packed message."""
    dense = plan.dense_members
    if not dense:
        return Pending([], lambda out: None)
    _flush_residuals(state, buffer, dense, counters)
    values = torch.cat([buffer[m.offset : m.offset + m.numel] for m in dense])
    counters.sent_bytes += values.numel() * values.element_size()
    counters.sent_numel += values.numel()
    world = state.world_size
    futures = [comm.all_reduce(values, state.process_group)] if world > 1 else []

    def apply(out: Tensor) -> None:
        values.div_(world)
        pos = 0
        for m in dense:
            out[m.offset : m.offset + m.numel].add_(values[pos : pos + m.numel])
            pos += m.numel

    return Pending(futures, apply)


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
