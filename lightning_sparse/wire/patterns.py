"""Wire patterns: how the coordinates a compressor chose cross the wire, and what that costs.

A compressor names its pattern (``Compressor.pattern``); :data:`PATTERNS` maps the name to a
:class:`WirePattern`, which compresses a bucket's sparse members (error feedback included), packs
them into one message, launches the collective(s) through the context's counted
:class:`~lightning_sparse.wire.comm.Collectives` and returns a
:class:`~lightning_sparse.wire.context.Pending` that adds the averaged values into whatever the
caller gives it (see :class:`~lightning_sparse.wire.context.Average`):

- :class:`GatherPattern` - each rank's own ``k`` (value, index) pairs, all-gathered or split;
- :class:`SharedPattern` - every rank picks the same coordinates (shared seed), values all-reduced;
- :class:`SketchPattern` - count-sketch tables all-reduced, then exact values at the candidates;
- :class:`DensePattern` - the tensors sent whole (warm-up, fallback, small tensors), all-reduced.

Each pattern's :meth:`WirePattern.wire_bytes` is its ring-model traffic, which the byte rule
(:func:`~lightning_sparse.wire.cost.sparse_pays`) compares with a dense all-reduce.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sparse._utils import all_finite, scratch
from lightning_sparse.compressors import CompressContext, CountSketch
from lightning_sparse.wire.comm import Rounds, futures, run, wait
from lightning_sparse.wire.context import BucketCall, Member, Pending, WireContext
from lightning_sparse.wire.cost import ring_all_gather_bytes, ring_all_reduce_bytes
from lightning_sparse.wire.message import MessageLayout, SparseSpace, quantize
from lightning_sparse.wire.select import flush_residuals, select_sorted, settle
from lightning_sparse.wire.shared import select_shared
from lightning_sparse.wire.sketch import eligible as sketch_at_once
from lightning_sparse.wire.sketch import launch_sketch
from lightning_sparse.wire.small import all_gather_message, launch_small
from lightning_sparse.wire.split import launch_split, split_wire_bytes

#: how a gather-pattern bucket crosses the wire (``exchange=...``)
EXCHANGES = ("auto", "allgather", "split")
#: ``exchange="auto"`` takes the split where it moves at most this fraction of the all-gather's wire
#: bytes (from about 16 ranks). The split applies about k coordinates where the all-gather applies
#: the union of every rank's k, and that costs accuracy: on a GPT with AdamW at 4 ranks the split
#: (0.78x the bytes) landed 0.07 nats further from dense; on a GRU with SGD at 8 ranks the split at
#: density 0.01 (0.50x the bytes) was 1.3 points below the all-gather, and the all-gather at half
#: the density (1.2x the split's bytes) still 1.0 point above it.
SPLIT_AUTO_RATIO = 0.25


@dataclass(frozen=True)
class Sizes:
    """What a bucket's sparse exchange costs depends on: ``ks`` of tensors of ``numels``, values of
    ``vbytes`` bytes, among ``world`` ranks, and how it crosses (compressor settings, exchange,
    index coding)."""

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
        """Bytes through each rank for the sparse members of a bucket (ring model); ``exchange``,
        ``compact`` (index coding) and ``value_bits`` matter to the gather pattern only."""
        return self.cost(Sizes(world, tuple(ks), vbytes, tuple(numels), compressor, exchange, compact, value_bits))

    def cost(self, sizes: Sizes) -> float:
        """:meth:`wire_bytes` of ``sizes``."""
        raise NotImplementedError

    def launch(self, ctx: WireContext, call: BucketCall, ks: list[int]) -> Pending:
        """Compress the bucket's sparse members, update their residuals, launch the collectives (a
        pattern implements this or :meth:`launch_rounds`)."""
        return run(self.launch_rounds(ctx, call, ks))

    def launch_rounds(self, ctx: WireContext, call: BucketCall, ks: list[int]) -> Rounds[Pending]:
        """:meth:`launch` in rounds (:data:`~lightning_sparse.wire.comm.Rounds`): a pattern whose
        second round needs the first's result yields between them; the others do not yield."""
        return self.launch(ctx, call, ks)
        yield  # a generator that returns at once


def bucket_wire_bytes(
    ctx: WireContext, ks: list[int], numels: list[int], vbytes: int, world: int | None = None
) -> float:
    """Ring-model bytes through each rank of a bucket's sparse exchange under ``ctx``'s settings."""
    pattern = PATTERNS[ctx.compressor.pattern]
    w = ctx.world_size if world is None else world
    return pattern.wire_bytes(w, ks, vbytes, numels, ctx.compressor, ctx.exchange, ctx.compact_indices, ctx.value_bits)


# --------------------------------------------------------------------------- gather
class GatherPattern(WirePattern):
    """Each rank selects its own ``k`` coordinates per tensor; two ways to combine them:

    - ``"allgather"``: every rank's (value, coordinate) pairs are all-gathered and summed, in rank
      order, by every rank. Traffic per rank grows with W: ``(W-1)`` messages.
    - ``"split"`` (Ok-Topk's sparse all-reduce, Li and Hoefler, PPoPP 2022): the coordinates are
      split among the ranks in blocks of ``SPLIT_BLOCK``, taken in turn; each rank sends each
      owner its pairs in the owner's region (one all-to-all, at most ``SPLIT_SLACK * k / W`` pairs
      per owner: the largest, when more fall there), every owner sums what it got, keeps the
      ``k / W`` largest sums and the owners' choices are all-gathered: the bucket's global
      selection, about ``k`` coordinates. Traffic per rank about ``3k (W-1)/W`` pairs, flat in W.
      What a rank selected and that did not reach the global selection (not chosen by its owner,
      or past its share) stays in its residual; the rounding of a sum to the value dtype stays in
      its owner's residual, so nothing is lost: sum over ranks of (sent + residual) is conserved.
      (:mod:`lightning_sparse.wire.split`.)

    ``"auto"`` takes the split where it moves at most :data:`SPLIT_AUTO_RATIO` of the all-gather's
    bytes through each rank under the ring model (from about 16 ranks), else the all-gather: the
    same choice on every rank (it depends only on sizes). Messages hold sparse-space coordinates
    (:class:`SparseSpace`), coded by :class:`MessageLayout`.
    """

    def choose(
        self,
        world: int,
        ks: list[int],
        vbytes: int,
        numels: list[int],
        exchange: str,
        compact: bool,
        value_bits: int | None = None,
    ) -> tuple[str, float]:
        """``(exchange, wire bytes per rank)`` for a bucket's sparse members.

        Asked up to three times per bucket and step (the byte fallback, the telemetry's label, the
        launch) and for every candidate of an adaptive density: the answer depends on sizes only
        and is kept."""
        return _choose(world, sum(ks), vbytes, sum(numels), exchange, compact, value_bits)

    def exchange_for(self, ctx: WireContext, ks: list[int], numels: list[int], vbytes: int) -> str:
        """The exchange a bucket takes under ``ctx``'s settings (what the launch and the telemetry use)."""
        return self.choose(ctx.world_size, ks, vbytes, numels, ctx.exchange, ctx.compact_indices, ctx.value_bits)[0]

    def cost(self, sizes: Sizes) -> float:
        s = sizes
        return self.choose(s.world, list(s.ks), s.vbytes, list(s.numels), s.exchange, s.compact, s.value_bits)[1]

    def launch_rounds(self, ctx: WireContext, call: BucketCall, ks: list[int]) -> Rounds[Pending]:
        vdtype = ctx.vdtype(call.buffer)
        numels = [m.numel for m in call.plan.sparse_members]
        if self.exchange_for(ctx, ks, numels, vdtype.itemsize) == "split":
            return (yield from launch_split(ctx, call, ks, vdtype))
        return _launch_allgather(ctx, call, ks, vdtype)


_DTYPE_OF_SIZE = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@functools.lru_cache(maxsize=4096)
def _choose(
    world: int, k: int, vbytes: int, n: int, exchange: str, compact: bool, bits: int | None
) -> tuple[str, float]:
    vdtype = _DTYPE_OF_SIZE[vbytes]
    gather = ring_all_gather_bytes(world, MessageLayout(n, k, vdtype, compact, value_bits=bits).size)
    if exchange == "allgather" or world <= 1:
        return "allgather", gather
    split = split_wire_bytes(world, n, k, vdtype, compact, bits)
    if exchange == "split" or split <= SPLIT_AUTO_RATIO * gather:
        return "split", split
    return "allgather", gather


def _launch_allgather(ctx: WireContext, call: BucketCall, ks: list[int], vdtype: torch.dtype) -> Pending:
    world = ctx.world_size
    space = SparseSpace.of(call.plan)
    layout = MessageLayout(space.numel, sum(ks), vdtype, ctx.compact_indices, value_bits=ctx.value_bits)
    coded = ctx.value_bits is not None
    sel = select_sorted(ctx, call, ks, vdtype, settle=not coded)
    message, arriving = layout.pack_arriving(sel.coords, sel.sent)
    if coded:  # what was sent is what the codes stand for: the rest stays in the residuals
        sel.sent = arriving
        settle(ctx, call, space, sel, torch.arange(sel.coords.numel(), device=sel.coords.device))
    call.counters.sent_numel += sel.coords.numel()
    gathered, issued = all_gather_message(ctx, call, message)

    def apply(out: Tensor, scale: float = 1.0) -> None:
        # every rank's message decoded at once, then added rank by rank: each rank's coordinates are
        # unique, so every add lands on its own coordinate and the sum over ranks happens in rank
        # order (identical bits on every rank, CUDA included, where one index_add_ of all of them
        # would add a coordinate's values in any order)
        coords, values = layout.unpack_rows(gathered.view(world, layout.size))
        at = space.to_bucket(coords.view(-1)).view(world, -1)
        values = values.to(out.dtype)
        for r in range(world):
            out.index_add_(0, at[r], values[r], alpha=scale / world)

    return Pending(issued, apply, chosen=True)


# --------------------------------------------------------------------------- shared
class SharedPattern(WirePattern):
    """Every rank picks the same coordinates (shared seed): only values are all-reduced."""

    def cost(self, sizes: Sizes) -> float:
        return ring_all_reduce_bytes(sizes.world, sum(sizes.ks) * sizes.vbytes)

    def launch(self, ctx: WireContext, call: BucketCall, ks: list[int]) -> Pending:
        world = ctx.world_size
        space = SparseSpace.of(call.plan)
        # every rank picks the same coordinates, so the values line up in every rank's message
        sel = select_shared(ctx, call, ks, ctx.vdtype(call.buffer))  # random-k: every member at once
        message = sel.sent
        call.counters.sent_numel += message.numel()
        issued = futures(ctx.comm.all_reduce(message, call.counters))

        def apply(out: Tensor) -> None:
            out.index_add_(0, space.to_bucket(sel.coords), message.to(out.dtype), alpha=1.0 / world)

        return Pending(issued, apply)


# --------------------------------------------------------------------------- sketch
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
    after it, before the hook returns (in update mode, every bucket's round 1 first, as one
    all-reduce, then every round 2: :meth:`launch_rounds`). Every collective of every bucket is therefore issued by
    the same thread in the same order on every rank; issuing round 2 from a completion callback
    (a process-group thread) could interleave it differently with other buckets' collectives on
    each rank. The cost is that backward waits for one small all-reduce per bucket.
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
        if sketch_at_once(ctx, call):  # every sparse member at once (lightning_sparse.wire.sketch)
            return (yield from launch_sketch(ctx, call, ks))
        compressor = typing.cast(CountSketch, ctx.compressor)  # the compressors of pattern "sketch" sketch
        world = ctx.world_size
        buffer, plan, counters = call.buffer, call.plan, call.counters
        vdtype = ctx.vdtype(buffer)
        members = plan.sparse_members
        shapes = [compressor.table_shape(m.numel, k) for m, k in zip(members, ks, strict=True)]
        # The tables live only until round 1 completes: a reused buffer saves the page faults of a
        # fresh multi-MB allocation every step. One per bucket: the buckets of an update exchange
        # hold theirs across their first rounds together.
        size = sum(r * c for r, c in shapes)
        tables = scratch(f"patterns.sketch_tables.{plan.label}", size, torch.float32, buffer.device).zero_()
        ps: list[Tensor | None] = []
        ctxs: list[CompressContext] = []
        views: list[Tensor] = []
        pos = 0
        for m, k, (rows, cols) in zip(members, ks, shapes, strict=True):
            g = call.input_of(m)
            cctx = ctx.compress_context(call.step, m)
            view = tables[pos : pos + rows * cols].view(rows, cols)
            p: Tensor | None = None
            if call.inputs_finite or all_finite(g):
                p = ctx.memory.accumulate(m.name, g) if ctx.error_feedback else g
                compressor.sketch(p, k, cctx, view)
            else:
                # Sketch nothing (the summed tables stay finite, so every rank still finds the same
                # candidates), then send NaN in round 2: every rank gets a non-finite average and
                # skips the step alike; this rank's residual keeps its previous value.
                counters.nonfinite_buckets = 1
            if call.observe is not None:  # as in select_sorted: every rank observes every member
                call.observe(call.step, plan.label, m.name, p if p is not None else g)
            ps.append(p)
            ctxs.append(cctx)
            views.append(view)
            pos += rows * cols
        first_round = ctx.comm.all_reduce(tables, counters)
        yield  # the other buckets' first rounds are issued meanwhile
        wait(first_round)  # round 1, on this thread (see above)
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

        picked: list[tuple[Tensor, Tensor]] = []  # per member: the k coordinates kept, their sums

        def pick() -> list[tuple[Tensor, Tensor]]:
            if not picked:
                start = 0
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
                    sent = quantize(exact, vdtype)
                    remainder = None if sent.dtype == exact.dtype else exact - sent.to(exact.dtype)
                    ctx.memory.keep_unsent(m.name, idx, remainder)
                if ctx.momentum_correction and p is not None:
                    ctx.velocity.mask(m.name, idx)

        def apply(out: Tensor) -> None:
            for m, (idx, sums) in zip(members, pick(), strict=True):
                out.index_add_(0, idx + m.offset, sums.to(out.dtype), alpha=1.0 / world)

        return Pending(issued, apply, settle=settle_residuals)


# --------------------------------------------------------------------------- dense
class DensePattern(WirePattern):
    """Tensors sent whole: their residuals flushed into them, then one all-reduce.

    :meth:`launch` sends the whole bucket (warm-up, fallback, a bucket of small tensors);
    :meth:`launch_members` the members below ``min_numel`` of a bucket sent sparse, packed into
    one message (with ``value_bits``, coded like the selected values and all-gathered, where that
    moves fewer bytes: :func:`~lightning_sparse.wire.quant.coded_members_pay`).
    """

    def cost(self, sizes: Sizes) -> float:
        return ring_all_reduce_bytes(sizes.world, sum(sizes.numels) * sizes.vbytes)

    def launch(self, ctx: WireContext, call: BucketCall, ks: list[int] | None = None) -> Pending:
        buffer, plan, world = call.buffer, call.plan, ctx.world_size
        flush_residuals(ctx, call, plan.members)
        if call.observe is not None:  # the bucket now holds p = g + e: an adaptive density learns from dense steps too
            for m in plan.sparse_members:
                call.observe(call.step, plan.label, m.name, call.segment(m))
        call.counters.sent_numel += buffer.numel()
        issued = futures(ctx.comm.all_reduce(buffer, call.counters))

        def dense() -> Tensor:
            return buffer.div_(world)

        return Pending(issued, lambda out: out.add_(dense()), dense)

    def launch_members(self, ctx: WireContext, call: BucketCall, members: tuple[Member, ...]) -> Pending:
        return launch_small(ctx, call, members)


#: the gather pattern (it also says which exchange a bucket takes: :meth:`GatherPattern.choose`)
GATHER = GatherPattern()
#: communication pattern name (``Compressor.pattern``) -> how it crosses the wire
PATTERNS: dict[str, WirePattern] = {"gather": GATHER, "shared": SharedPattern(), "sketch": SketchPattern()}
#: the tensors sent whole
DENSE = DensePattern()
