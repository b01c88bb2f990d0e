"""Wire patterns: how the coordinates a compressor chose cross the wire, and what that costs.

:data:`PATTERNS` maps a compressor's ``pattern`` (gather, shared, sketch) to a :class:`WirePattern`, which compresses
a bucket's sparse members, launches the collectives and returns a :class:`~lightning_sparse.wire.context.Pending`.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sparse._utils import all_finite, scratch
from lightning_sparse.compressors.base import SketchCompressor
from lightning_sparse.wire.batched import unsent
from lightning_sparse.wire.comm import Rounds, futures, run, wait
from lightning_sparse.wire.context import BY_COUNT, BucketCall, Pending, WireContext
from lightning_sparse.wire.message import MessageLayout, SparseSpace, quantize
from lightning_sparse.wire.select import all_gather_message, flush_residuals, launch_small, select_sorted, settle
from lightning_sparse.wire.shared import select_shared
from lightning_sparse.wire.sketch import eligible as sketch_at_once
from lightning_sparse.wire.sketch import launch_sketch
from lightning_sparse.wire.split import launch_split, split_wire_bytes
from lightning_sparse.wire.stats import ring_all_gather_bytes, ring_all_reduce_bytes

#: how a gather-pattern bucket crosses the wire (``exchange=...``)
EXCHANGES = ("auto", "allgather", "split")
#: ``exchange="auto"`` takes the split where it moves at most this fraction of the all-gather's wire bytes:
#: it applies about k coordinates where the all-gather applies every rank's k, which costs accuracy
SPLIT_AUTO_RATIO = 0.25
_DTYPE_OF_SIZE = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@dataclass(frozen=True)
class Sizes:
    """What a bucket's sparse exchange costs depends on (the arguments of :meth:`WirePattern.wire_bytes`)."""

    world: int
    ks: tuple[int, ...]
    vbytes: int
    numels: tuple[int, ...]
    compressor: Any = None
    exchange: str = "allgather"
    compact: bool = False
    value_bits: int | None = None


class WirePattern:
    """How the coordinates chosen by a compressor cross the wire (one class per ``pattern``)."""

    def wire_bytes(
        self,
        world: int,
        ks: list[int],
        vbytes: int,
        numels: list[int],
        compressor: Any = None,
        exchange: str = "allgather",
        compact: bool = False,
        value_bits: int | None = None,
    ) -> float:
        """Bytes through each rank for the sparse members of a bucket (ring model)."""
        return self.cost(Sizes(world, tuple(ks), vbytes, tuple(numels), compressor, exchange, compact, value_bits))

    def cost(self, sizes: Sizes) -> float:
        """:meth:`wire_bytes` of ``sizes``."""
        raise NotImplementedError

    def launch(self, ctx: WireContext, call: BucketCall, ks: list[int]) -> Pending:
        """Compress the bucket's sparse members, update their residuals, launch the collectives."""
        return run(self.launch_rounds(ctx, call, ks))

    def launch_rounds(self, ctx: WireContext, call: BucketCall, ks: list[int]) -> Rounds[Pending]:
        """:meth:`launch` in rounds (:data:`~lightning_sparse.wire.comm.Rounds`), yielding where a round
        needs the previous one's result (a pattern implements this or :meth:`launch`)."""
        return self.launch(ctx, call, ks)
        yield  # a generator that returns at once


def bucket_wire_bytes(
    ctx: WireContext, ks: list[int], numels: list[int], vbytes: int, world: int | None = None
) -> float:
    """Ring-model bytes through each rank of a bucket's sparse exchange under ``ctx``'s settings."""
    pattern = PATTERNS[ctx.compressor.pattern]
    w = ctx.world_size if world is None else world
    return pattern.wire_bytes(w, ks, vbytes, numels, ctx.compressor, ctx.exchange, ctx.compact_indices, ctx.value_bits)


class GatherPattern(WirePattern):
    """Each rank selects its own ``k`` coordinates per tensor, then ``"allgather"`` (every rank sums every
    rank's pairs, in rank order) or ``"split"`` (:mod:`~lightning_sparse.wire.split`); ``"auto"`` takes the
    split where it moves at most :data:`SPLIT_AUTO_RATIO` of the all-gather's bytes (sizes only: the same
    on every rank)."""

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def choose(
        world: int, k: int, vbytes: int, n: int, exchange: str, compact: bool, bits: int | None = None
    ) -> tuple[str, float]:
        """``(exchange, wire bytes per rank)`` for ``k`` of a bucket's ``n`` sparse coordinates (sizes only)."""
        vdtype = _DTYPE_OF_SIZE[vbytes]
        gather = ring_all_gather_bytes(world, MessageLayout(n, k, vdtype, compact, value_bits=bits).size)
        if exchange == "allgather" or world <= 1:
            return "allgather", gather
        split = split_wire_bytes(world, n, k, vdtype, compact, bits)
        if exchange == "split" or split <= SPLIT_AUTO_RATIO * gather:
            return "split", split
        return "allgather", gather

    def exchange_for(self, ctx: WireContext, ks: list[int], numels: Sequence[int], vbytes: int) -> str:
        """The exchange a bucket takes under ``ctx``'s settings (what the launch and the telemetry use)."""
        return self.choose(
            ctx.world_size, sum(ks), vbytes, sum(numels), ctx.exchange, ctx.compact_indices, ctx.value_bits
        )[0]

    def cost(self, sizes: Sizes) -> float:
        s = sizes
        return self.choose(s.world, sum(s.ks), s.vbytes, sum(s.numels), s.exchange, s.compact, s.value_bits)[1]

    def launch_rounds(self, ctx: WireContext, call: BucketCall, ks: list[int]) -> Rounds[Pending]:
        vdtype = ctx.vdtype(call.buffer)
        if self.exchange_for(ctx, ks, call.plan.sparse_numels, vdtype.itemsize) == "split":
            return (yield from launch_split(ctx, call, ks, vdtype))
        return _launch_allgather(ctx, call, ks, vdtype)


def _launch_allgather(ctx: WireContext, call: BucketCall, ks: list[int], vdtype: torch.dtype) -> Pending:
    world = ctx.world_size
    space = SparseSpace.of(call.plan)
    layout = MessageLayout.of(space.numel, sum(ks), vdtype, ctx.compact_indices, bits=ctx.value_bits)
    coded = ctx.value_bits is not None
    sel = select_sorted(ctx, call, ks, vdtype, settle=not coded)
    out = scratch(f"gather.message.{call.plan.label}", layout.size, torch.uint8, call.buffer.device)
    message, arriving = layout.pack_arriving(sel.coords, sel.sent, out)
    if coded:  # what was sent is what the codes stand for: the rest stays in the residuals
        sel.sent = arriving
        settle(ctx, call, space, sel, torch.arange(sel.coords.numel(), device=sel.coords.device))
    call.counters.sent_numel += sel.coords.numel()
    gathered, issued = all_gather_message(ctx, call, message, "gather.received")

    def apply(out: Tensor, scale: float | str = 1.0) -> None:
        # rank by rank: one index_add_ of all of them would add a coordinate's values in any order on CUDA
        coords, values = layout.unpack_rows(gathered.view(world, layout.size))
        at = space.to_bucket(coords.view(-1)).view(world, -1)
        values = values.to(out.dtype)
        if scale == BY_COUNT:  # each value / max(c, 2): 0.5 exactly where one or two parties chose it
            chose = scratch(f"gather.count.{call.plan.label}", out.numel(), out.dtype, out.device).zero_()
            chose.index_add_(0, at.view(-1), torch.ones((), dtype=out.dtype, device=out.device).expand(at.numel()))
            values, alpha = values * chose[at].clamp_(min=2.0).reciprocal_(), 1.0
        else:
            alpha = float(scale) / world
        for r in range(world):
            out.index_add_(0, at[r], values[r], alpha=alpha)

    return Pending(issued, apply, chosen=True)


class SharedPattern(WirePattern):
    """Every rank picks the same coordinates (shared seed): only values are all-reduced."""

    def cost(self, sizes: Sizes) -> float:
        return ring_all_reduce_bytes(sizes.world, sum(sizes.ks) * sizes.vbytes)

    def launch(self, ctx: WireContext, call: BucketCall, ks: list[int]) -> Pending:
        world = ctx.world_size
        space = SparseSpace.of(call.plan)
        sel = select_shared(ctx, call, ks, ctx.vdtype(call.buffer))  # the same coordinates on every rank
        message = sel.sent
        call.counters.sent_numel += message.numel()
        issued = futures(ctx.comm.all_reduce(message, call.counters))

        def apply(out: Tensor) -> None:
            out.index_add_(0, space.to_bucket(sel.coords), message.to(out.dtype), alpha=1.0 / world)

        return Pending(issued, apply)


class SketchPattern(WirePattern):
    """Count-sketch (Sketched SGD): round 1 all-reduces the sparse members' float32 tables, round 2 this
    rank's ``p`` at the candidates every rank finds in the sums; each member keeps its ``k`` largest sums.

    Round 1 is waited for on the hook's thread and round 2 issued right after, so that one thread issues
    every collective in the same order on every rank (a completion callback's thread would not).
    """

    def cost(self, sizes: Sizes) -> float:
        compressor = sizes.compressor
        if compressor is None:
            raise ValueError("the sketch pattern's wire size depends on the compressor's settings: pass compressor")
        pairs = list(zip(sizes.numels, sizes.ks, strict=True))
        table_bytes = sum(r * c for r, c in (compressor.table_shape(n, k) for n, k in pairs)) * 4
        value_bytes = sum(compressor.num_candidates(n, k) for n, k in pairs) * sizes.vbytes
        return ring_all_reduce_bytes(sizes.world, table_bytes) + ring_all_reduce_bytes(sizes.world, value_bytes)

    def launch_rounds(self, ctx: WireContext, call: BucketCall, ks: list[int]) -> Rounds[Pending]:
        if sketch_at_once(ctx, call):
            return (yield from launch_sketch(ctx, call, ks))
        compressor = typing.cast(SketchCompressor, ctx.compressor)
        world = ctx.world_size
        buffer, plan, counters = call.buffer, call.plan, call.counters
        vdtype = ctx.vdtype(buffer)
        members = plan.sparse_members
        shapes = [compressor.table_shape(m.numel, k) for m, k in zip(members, ks, strict=True)]
        # reused (no page faults of a fresh allocation); one per bucket, as update mode's rounds overlap
        size = sum(r * c for r, c in shapes)
        tables = scratch(f"patterns.sketch_tables.{plan.label}", size, torch.float32, buffer.device).zero_()
        ctxs = [ctx.compress_context(call.step, m) for m in members]
        ps: list[Tensor | None] = []
        views: list[Tensor] = []
        pos = 0
        for m, k, cctx, (rows, cols) in zip(members, ks, ctxs, shapes, strict=True):
            g = call.input_of(m)
            view = tables[pos : pos + rows * cols].view(rows, cols)
            p: Tensor | None = None
            if call.inputs_finite or all_finite(g):
                p = ctx.memory.accumulate(m.name, g) if ctx.error_feedback else g
                compressor.sketch(p, k, cctx, view)
            else:  # sketch nothing (the same candidates on every rank), send NaN: every rank skips the step
                counters.nonfinite_buckets = 1
            if call.observe is not None:  # as in select_sorted: every rank observes every member
                call.observe(call.step, plan.label, m.name, p if p is not None else g)
            ps.append(p)
            views.append(view)
            pos += rows * cols
        first_round = ctx.comm.all_reduce(tables, counters)
        yield  # the other buckets' first rounds are issued meanwhile
        wait(first_round)  # on this thread (see above)
        cands = [
            compressor.candidates(view, m.numel, k, cctx)
            for view, m, k, cctx in zip(views, members, ks, ctxs, strict=True)
        ]
        values = torch.empty(sum(c.numel() for c in cands), dtype=vdtype, device=buffer.device)
        pos = 0
        for p, cand in zip(ps, cands, strict=True):
            if p is None:
                values[pos : pos + cand.numel()].fill_(float("nan"))
            else:
                values[pos : pos + cand.numel()].copy_(quantize(p[cand], vdtype))
            pos += cand.numel()
        counters.sent_numel += sum(ks)
        issued = futures(ctx.comm.all_reduce(values, counters))

        @functools.cache
        def pick() -> list[tuple[Tensor, Tensor]]:
            """Per member: the ``k`` coordinates kept, their sums."""
            picked, start = [], 0
            for k, cand in zip(ks, cands, strict=True):
                sums = values[start : start + cand.numel()]
                start += cand.numel()
                chosen = compressor.pick(sums, k)
                picked.append((cand[chosen], sums[chosen]))
            return picked

        def settle_residuals() -> None:  # what this rank contributed at the kept coordinates
            for m, p, (idx, _) in zip(members, ps, pick(), strict=True):
                if ctx.error_feedback and p is not None:  # p: the residual buffer, untouched since launch
                    exact = p[idx]
                    ctx.memory.keep_unsent(m.name, idx, unsent(exact, quantize(exact, vdtype), coded=False))
                if ctx.momentum_correction and p is not None:
                    ctx.velocity.mask(m.name, idx)

        def apply(out: Tensor) -> None:
            for m, (idx, sums) in zip(members, pick(), strict=True):
                out.index_add_(0, idx + m.offset, sums.to(out.dtype), alpha=1.0 / world)

        return Pending(issued, apply, settle=settle_residuals)


class DensePattern(WirePattern):
    """Tensors sent whole, their residuals flushed into them: the whole bucket (:meth:`launch`), or the
    small tensors of a bucket sent sparse (:meth:`launch_members`)."""

    def cost(self, sizes: Sizes) -> float:
        return ring_all_reduce_bytes(sizes.world, sum(sizes.numels) * sizes.vbytes)

    def launch(self, ctx: WireContext, call: BucketCall, ks: list[int] | None = None) -> Pending:
        buffer, plan, world = call.buffer, call.plan, ctx.world_size
        flush_residuals(ctx, call, plan.members)
        if call.observe is not None:  # the bucket holds p = g + e: a density schedule learns from dense steps too
            for m in plan.sparse_members:
                call.observe(call.step, plan.label, m.name, call.segment(m))
        call.counters.sent_numel += buffer.numel()
        issued = futures(ctx.comm.all_reduce(buffer, call.counters))

        def dense() -> Tensor:
            return buffer.div_(world)

        return Pending(issued, lambda out: out.add_(dense()), dense)

    #: ``launch_members(ctx, call, members)``: the small tensors of a bucket sent sparse
    launch_members = staticmethod(launch_small)


#: the gather pattern (it also says which exchange a bucket takes: :meth:`GatherPattern.choose`)
GATHER = GatherPattern()
#: communication pattern name (``Compressor.pattern``) -> how it crosses the wire
PATTERNS: dict[str, WirePattern] = {"gather": GATHER, "shared": SharedPattern(), "sketch": SketchPattern()}
#: the tensors sent whole
DENSE = DensePattern()
