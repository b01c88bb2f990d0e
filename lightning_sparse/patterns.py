"""Wire patterns: how the coordinates a compressor chose cross the wire, and what that costs.

A compressor names its pattern (``Compressor.pattern``); :data:`PATTERNS` maps the name to a
:class:`WirePattern`, which compresses a bucket's sparse members (error feedback included), packs
them into one message, launches the collective(s) and returns a :class:`Pending` that adds the
averaged values into the bucket (gradient hook) or the global parameters (update exchange):

- :class:`GatherPattern` - each rank's own ``k`` (value, index) pairs, all-gathered;
- :class:`SharedPattern` - every rank picks the same coordinates (shared seed), values all-reduced;
- :class:`SketchPattern` - count-sketch tables all-reduced, then exact values at the candidates.

The ring byte models (:func:`ring_all_reduce_bytes`, :func:`ring_all_gather_bytes`) are the one
place the package turns message sizes into traffic: they give each pattern's modelled wire size
(:meth:`WirePattern.wire_bytes`), which the hook's byte fallback and the adaptive density schedule
compare, and every collective actually issued is counted through :func:`count_all_reduce` /
:func:`count_all_gather`, which add the bytes handed to it (``Counters.sent_bytes``) and the bytes
the ring model says it moves through this rank (``Counters.wire_bytes``).

Layering: the hook (:mod:`lightning_sparse.hook`) decides per bucket between dense and sparse and
orchestrates the exchange; this module sits below it and below the density schedules, and imports
only the compressors, the collectives, the counters and the small helpers. It reads the hook's
:class:`~lightning_sparse.state.SparseState` through its attributes (the name is imported for
type checkers only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.futures import Future

from lightning_sparse import comm
from lightning_sparse._utils import all_finite, scratch
from lightning_sparse.compressors import CompressContext
from lightning_sparse.stats import Counters

if TYPE_CHECKING:
    from lightning_sparse.state import BucketPlan, Member, SparseState


_INDEX_BYTES = 4  # indices travel as int32 (bucket offsets); buckets are far below 2**31 elements


# --------------------------------------------------------------------------- byte models
def ring_all_reduce_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-reduce of ``nbytes``."""
    return 2.0 * (world - 1) / world * nbytes


def ring_all_gather_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-gather of ``nbytes`` per rank."""
    return float((world - 1) * nbytes)


def count_all_reduce(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-reduce of ``nbytes`` this rank issued: the bytes handed to it, and its ring traffic."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += ring_all_reduce_bytes(world, nbytes)


def count_all_gather(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-gather of ``nbytes`` per rank this rank issued: the bytes handed to it, and its
    ring traffic."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += ring_all_gather_bytes(world, nbytes)


def count_dense(counters: Counters, world: int, nbytes: int) -> None:
    """Record ``nbytes`` of gradient that plain DDP would all-reduce, and what that would move."""
    counters.dense_bytes += nbytes
    counters.dense_wire_bytes += ring_all_reduce_bytes(world, nbytes)


def _gather_message_bytes(k: int, vbytes: int) -> int:
    raw = k * (_INDEX_BYTES + vbytes)
    return (raw + 7) // 8 * 8  # every rank's chunk starts 8-byte aligned so its views are valid


# --------------------------------------------------------------------------- compression
def _value_dtype(state: SparseState, buffer: Tensor) -> torch.dtype:
    return state.value_dtype or buffer.dtype


def gradient_of(state: SparseState, buffer: Tensor, m: Member) -> Tensor:
    """What the hook compresses for member ``m``: its gradient, or its local momentum (float32)."""
    source = state.sources.get(m.name)
    return source if source is not None else buffer[m.offset : m.offset + m.numel]


def _flush_residuals(state: SparseState, buffer: Tensor, members: tuple[Member, ...], counters: Counters) -> None:
    """Add any residual into the bucket before a dense send, so nothing stays behind unsent."""
    if not state.error_feedback:
        return
    for m in members:
        if m.name in state.memory:
            segment = buffer[m.offset : m.offset + m.numel]
            if not state.inputs_finite and not all_finite(segment):
                # Send the non-finite gradient as it is (every rank then sees a non-finite average
                # and the optimizer / gradient scaler skips the step); keep the residual unpoisoned.
                counters.nonfinite_buckets = 1
                continue
            state.memory.accumulate(m.name, segment)
            sent = state.memory.flush(m.name, buffer.dtype)
            assert sent is not None
            segment.copy_(sent)


# --------------------------------------------------------------------------- patterns
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
        if not state.inputs_finite and not all_finite(g):
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
        count_all_gather(counters, world, message.numel())
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
        count_all_reduce(counters, world, message.numel() * message.element_size())
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
        tables = scratch("patterns.sketch_tables", sum(r * c for r, c in shapes), torch.float32, buffer.device).zero_()
        ps: list[Tensor | None] = []
        ctxs: list[CompressContext] = []
        views: list[Tensor] = []
        pos = 0
        for m, k, (rows, cols) in zip(members, ks, shapes, strict=True):
            g = gradient_of(state, buffer, m)
            ctx = CompressContext(step=state.step, key=m.key, rank=state.rank, world_size=world, seed=state.seed)
            view = tables[pos : pos + rows * cols].view(rows, cols)
            p: Tensor | None = None
            if state.inputs_finite or all_finite(g):
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
        count_all_reduce(counters, world, tables.numel() * tables.element_size())
        count_all_reduce(counters, world, values.numel() * values.element_size())
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
    world = state.world_size
    count_all_reduce(counters, world, values.numel() * values.element_size())
    counters.sent_numel += values.numel()
    futures = [comm.all_reduce(values, state.process_group)] if world > 1 else []

    def apply(out: Tensor) -> None:
        values.div_(world)
        pos = 0
        for m in dense:
            out[m.offset : m.offset + m.numel].add_(values[pos : pos + m.numel])
            pos += m.numel

    return Pending(futures, apply)
