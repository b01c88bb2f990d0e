"""Count-sketch (Sketched SGD) of every sparse member of a bucket at once, in a fixed number of operators.

Round 1 all-reduces every member's ``rows x cols`` table of its pre-truncated ``p = g + e``; each member's
``c = ceil(p2 * k)`` largest estimates are its candidates, and round 2 all-reduces ``p`` there; per member the
``k`` largest ``|sums|`` are applied and the residual keeps the rest (``sent + e_new == p``). The hashes are
drawn per bucket from (seed, step, the bucket's members): the same on every rank, not the per-tensor draws.
A member whose input is not finite sketches nothing and sends NaN; its residual keeps its old value.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse._utils import RegionViews, make_generator, mix_seed, scratch
from lightning_sparse.compressors.base import SketchCompressor
from lightning_sparse.compressors.sketch_hashes import median_of_rows
from lightning_sparse.compressors.topk import sample_rank
from lightning_sparse.wire.batched import (
    CPU_ONE_BY_ONE,
    keep_unsent,
    rank_shortlist,
    residual_layout,
    shortlist_sizes,
)
from lightning_sparse.wire.comm import Rounds, futures, wait
from lightning_sparse.wire.context import BucketCall, BucketPlan, Pending, WireContext
from lightning_sparse.wire.message import quantize
from lightning_sparse.wire.select import nonfinite_members
from lightning_sparse.wire.shared import add_to_residuals

__all__ = ["AT_ONCE_ENTRIES", "SketchLayout", "eligible", "launch_sketch", "sketch_tables"]

#: a bucket of more ``rows * numel`` sparse entries takes the per-tensor path
AT_ONCE_ENTRIES = 1 << 26
#: draws per member for the pre-truncation thresholds
_CUT_DRAWS = (4096, 1 << 14)
_BITS = 0x7FFFFFFF
_HASH_TAG = 0x5CE7C4
_CUT_TAG = 0x5CE7C7


@dataclass
class SketchLayout:
    """What the count-sketch of one bucket needs, made once per (plan, ks, compressor, device).

    Coordinates ``q`` run over the sparse members' entries one after the other, in buffer order.

    Example:
        >>> from lightning_sparse.compressors import CountSketch
        >>> from lightning_sparse.wire.context import BucketPlan, Member
        >>> plan = BucketPlan((Member("w", 1, 0, 1000, True), Member("b", 2, 1000, 4, False)), 1004, "w, b")
        >>> layout = SketchLayout.of(plan, (10,), CountSketch(rows=3), torch.device("cpu"))
        >>> layout.numel, layout.tables, layout.cand_member.numel(), tuple(layout.block_cols.tolist())
        (1000, 300, 40, (100, 100, 100, 100, 100, 100, 100, 100, 100, 100))
    """

    numel: int  # sparse coordinates
    tables: int  # rows * sum of cols: the round-1 message
    capacity: int
    draws: int
    deepest: int
    cut_draws: int  # 0: nothing is pre-truncated
    cut_deepest: int
    seed_key: int  # the bucket's members, for the shared draws
    block_of: Tensor  # int32 (numel,): each coordinate's block
    block_cols: Tensor  # (blocks,) its member's cols
    block_wide: Tensor  # (rows, blocks): where row r of its member's doubled table starts, less the block's start
    unfold: Tensor  # int32 (2 * tables,): each slot of the doubled tables' slot in the tables
    block_member: Tensor  # (blocks,)
    member_numel: Tensor  # (S, 1), for the draws
    member_start: Tensor  # (S, 1)
    member_ends: Tensor  # (S,)
    members: Tensor  # arange(S)
    cs: Tensor  # (S,) candidates per member
    rank_col: Tensor  # (S, 1) the sample rank that estimates the c-th largest estimate, minus 1
    take_all: Tensor  # (S,) c >= numel
    head_end: Tensor  # (S,) member start + c
    cut_rank_col: Tensor  # (S, 1) the sample rank that estimates the (p1 * k)-th largest |p|, minus 1
    cut_all: Tensor  # (S,) nothing to truncate
    cand_member: Tensor  # (C,) each candidate slot's member: C is the round-2 message
    cand_local: Tensor  # (C,) its rank within the member
    cand_shift: Tensor  # (C,) bucket offset minus sparse coordinate, of its member
    cand_base: Tensor  # (C,) its sort key's member part, plus _BITS
    pick_slots: Tensor  # (K,) the sorted sums' slots that hold each member's k largest
    residual_views: RegionViews  # the sparse members' regions of the flat residual
    input_views: RegionViews  # and of the bucket's input
    member_sizes: tuple[int, ...]  # every member's numel, buffer order (empty: the members leave gaps)
    sparse_regions: tuple[int, ...]  # the sparse members' positions among them
    spans: tuple[tuple[int, int, int, int, int], ...]  # per member: q start, numel, c, first slot, k

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(plan: BucketPlan, ks: tuple[int, ...], compressor: SketchCompressor, device: torch.device) -> SketchLayout:
        sparse = plan.sparse_members
        rows = compressor.rows
        numels = [m.numel for m in sparse]
        cols = [compressor.table_shape(d, k)[1] for d, k in zip(numels, ks, strict=True)]
        cs = [compressor.num_candidates(d, k) for d, k in zip(numels, ks, strict=True)]
        p1 = compressor.truncation(device)
        cuts = [math.ceil(p1 * k) for k in ks]
        starts = [sum(numels[:i]) for i in range(len(numels))]
        block_cols, block_member, block_sizes, block_wide = [], [], [], []
        table = 0
        for i, (q, d, c) in enumerate(zip(starts, numels, cols, strict=True)):
            for b in range(-(-d // c)):
                block_sizes.append(min(c, d - b * c))
                block_cols.append(c)
                block_member.append(i)
                block_wide.append([2 * (table + r * c) - (q + b * c) for r in range(rows)])
            table += rows * c
        # the doubled tables: each row twice side by side, so a block's buckets need no wrap around
        unfold = torch.cat(
            [
                (torch.arange(rows).unsqueeze(1) * c + torch.arange(c).repeat(2)).view(-1) + rows * sum(cols[:i])
                for i, c in enumerate(cols)
            ]
        )
        n = sum(numels)
        ratio = max(d / c for d, c in zip(numels, cs, strict=True))
        draws, ranks, capacity = shortlist_sizes(numels, cs, ratio, n)
        cutting = [0 < m < d for m, d in zip(cuts, numels, strict=True)]
        wanted = [math.ceil(64 * d / m) for m, d, on in zip(cuts, numels, cutting, strict=True) if on]
        cut_draws = min(_CUT_DRAWS[1], max(_CUT_DRAWS[0], *wanted)) if wanted else 0
        cut_ranks = [
            sample_rank(cut_draws, m, d, 0.0) - 1 if on else 0 for m, d, on in zip(cuts, numels, cutting, strict=True)
        ]
        firsts = [sum(cs[:i]) for i in range(len(cs))]
        tiled = all(m.offset == sum(o.numel for o in plan.members[:i]) for i, m in enumerate(plan.members))
        long = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        cand_member = [i for i, c in enumerate(cs) for _ in range(c)]
        return SketchLayout(
            numel=n,
            tables=table,
            capacity=capacity,
            draws=draws,
            deepest=max(ranks) + 1,
            cut_draws=cut_draws,
            cut_deepest=max(cut_ranks) + 1,
            seed_key=mix_seed(len(sparse), *(m.key for m in sparse)),
            block_of=torch.repeat_interleave(long(block_sizes), output_size=n).to(torch.int32),
            block_cols=long(block_cols),
            block_wide=long(block_wide).t().contiguous(),
            unfold=unfold.to(device=device, dtype=torch.int32),
            block_member=long(block_member),
            member_numel=long(numels).unsqueeze(1),
            member_start=long(starts).unsqueeze(1),
            member_ends=long([q + d for q, d in zip(starts, numels, strict=True)]),
            members=long(list(range(len(sparse)))),
            cs=long(cs),
            rank_col=long(ranks).unsqueeze(1),
            take_all=torch.tensor([c >= d for d, c in zip(numels, cs, strict=True)], device=device),
            head_end=long([q + c for q, c in zip(starts, cs, strict=True)]),
            cut_rank_col=long(cut_ranks).unsqueeze(1),
            cut_all=torch.tensor([not on for on in cutting], device=device),
            cand_member=long(cand_member),
            cand_local=long([j for c in cs for j in range(c)]),
            cand_shift=long([sparse[i].offset - starts[i] for i in cand_member]),
            cand_base=long([(i << 32) + _BITS for i in cand_member]),
            pick_slots=long([f + j for f, k in zip(firsts, ks, strict=True) for j in range(k)]),
            residual_views=RegionViews(tuple((m.offset, m.numel) for m in sparse)),
            input_views=RegionViews(tuple((m.offset, m.numel) for m in sparse)),
            member_sizes=tuple(m.numel for m in plan.members) if tiled else (),
            sparse_regions=tuple(i for i, m in enumerate(plan.members) if m.sparse),
            spans=tuple(zip(starts, numels, cs, firsts, ks, strict=True)),
        )


def eligible(ctx: WireContext, call: BucketCall) -> bool:
    """Whether ``call``'s sparse members can be sketched at once (fixed buckets: the hashes are drawn per bucket;
    residuals that live with the bucket; within :data:`AT_ONCE_ENTRIES` and :data:`CPU_ONE_BY_ONE`)."""
    sparse = call.plan.sparse_members
    if ctx.at_once != "countsketch" or not sparse or not ctx.fixed_buckets or ctx.momentum_correction:
        return False
    if call.sources or (ctx.error_feedback and ctx.memory.home is not None):
        return False
    rows = typing.cast(SketchCompressor, ctx.compressor).rows
    largest = max(m.numel for m in sparse) if call.buffer.device.type == "cpu" else 0
    return rows * sum(m.numel for m in sparse) <= AT_ONCE_ENTRIES and rows * largest <= CPU_ONE_BY_ONE


def _hashes(ctx: WireContext, call: BucketCall, layout: SketchLayout) -> tuple[Tensor, torch.Generator]:
    """Each block's start in the signed doubled tables (int32, ``(rows, blocks)``), and the shared generator."""
    device = call.buffer.device
    gen = make_generator(device, mix_seed(ctx.seed, _HASH_TAG, call.step, layout.seed_key))
    draws = torch.randint(0, 1 << 62, (2, *layout.block_wide.shape), generator=gen, device=device)
    shift = draws[0].remainder_(layout.block_cols).add_(layout.block_wide)
    negative = draws[1].bitwise_and_(1).mul_(layout.unfold.numel())
    return shift.add_(negative).to(torch.int32), gen


def _buckets(layout: SketchLayout, hashes: Tensor) -> list[Tensor]:
    """Per row (contiguous), where each sparse coordinate lands in the signed doubled tables (int32)."""
    q = torch.arange(layout.numel, dtype=torch.int32, device=hashes.device)
    return [row.index_select(0, layout.block_of).add_(q) for row in hashes.unbind(0)]


def _thresholds(
    a: Tensor, layout: SketchLayout, draws: int, deepest: int, rank_col: Tensor, gen: torch.Generator
) -> Tensor:
    """Per member, the ``rank_col``-th largest of ``draws`` uniform draws of its entries of ``a``."""
    at = torch.randint(0, 1 << 62, (layout.members.numel(), draws), generator=gen, device=a.device)
    at.remainder_(layout.member_numel).add_(layout.member_start)
    top = torch.topk(a[at], deepest, dim=1).values
    return top.gather(1, rank_col).squeeze(1)


def _per_coordinate(values: Tensor, layout: SketchLayout) -> Tensor:
    """A per-member tensor spread to every sparse coordinate."""
    return values.index_select(0, layout.block_member).index_select(0, layout.block_of)


def sketch_tables(
    ctx: WireContext, call: BucketCall, layout: SketchLayout, x: Tensor, tables: Tensor
) -> tuple[Tensor, torch.Generator]:
    """Add this rank's ``x`` (the sparse members' ``p``, float32) into ``tables``, pre-truncated as
    ``p1`` says. Returns the hashes and the shared generator (see :func:`_hashes`)."""
    if layout.cut_draws:
        gen = make_generator(x.device, mix_seed(ctx.seed, _CUT_TAG, ctx.rank, call.step, layout.seed_key))
        a = x.abs()
        cut = _thresholds(a, layout, layout.cut_draws, layout.cut_deepest, layout.cut_rank_col, gen)
        x = torch.where(a > _per_coordinate(torch.where(layout.cut_all, -1.0, cut), layout), x, 0.0)
    hashes, shared = _hashes(ctx, call, layout)
    wide = scratch("sketch.wide", 2 * layout.unfold.numel(), torch.float32, x.device).zero_()
    for at in _buckets(layout, hashes):
        wide.index_add_(0, at, x)
    positive, negative = wide.chunk(2)
    tables.index_add_(0, layout.unfold, positive)  # fold the doubled tables, signs applied
    tables.index_add_(0, layout.unfold, negative, alpha=-1.0)
    return hashes, shared


def _candidates(layout: SketchLayout, a: Tensor, q: Tensor, gen: torch.Generator) -> Tensor:
    """Each member's ``c`` largest of ``a[:numel]`` (``|estimates|``; ``a[numel] = -1``), as sparse coordinates."""
    n = layout.numel
    threshold = _thresholds(a, layout, layout.draws, layout.deepest, layout.rank_col, gen)
    # zeros never pass (c >= numel: everything does); a member whose threshold is 0 (most of its
    # estimates are, an idle parameter's) passes its first c coordinates besides its non-zeros
    head = _per_coordinate(torch.where(threshold > 0, 0, layout.head_end), layout)
    threshold = torch.where(layout.take_all, -1.0, threshold.clamp_min(torch.finfo(torch.float32).tiny))
    mask = torch.ge(a[:n], _per_coordinate(threshold, layout)).logical_or_(q < head)
    ranked, starts, counts, passed = rank_shortlist(a, mask, layout.capacity, layout.member_ends, layout.members)
    if bool((counts < layout.cs).any() | (passed > layout.capacity)):  # the one host read; rare
        return _candidates_one_by_one(layout, a)
    return ranked[starts.index_select(0, layout.cand_member).add_(layout.cand_local)]


def _candidates_one_by_one(layout: SketchLayout, a: Tensor) -> Tensor:
    """:func:`_candidates` by a ``topk`` per member (where a shortlist fell short or overflowed)."""
    return torch.cat([torch.topk(a[q0 : q0 + d], c).indices.add_(q0) for q0, d, c, _, _ in layout.spans])


def _sparse_parts(buffer: Tensor, plan: BucketPlan, layout: SketchLayout) -> list[Tensor]:
    """The sparse members' slices of ``buffer``: one ``split`` where the members tile it."""
    if layout.member_sizes and buffer.numel() == plan.numel:
        parts = torch.split(buffer, list(layout.member_sizes))
        return [parts[i] for i in layout.sparse_regions]
    return layout.input_views.of(buffer)


def launch_sketch(ctx: WireContext, call: BucketCall, ks: list[int]) -> Rounds[Pending]:
    """:meth:`SketchPattern.launch_rounds <lightning_sparse.wire.patterns.SketchPattern.launch_rounds>`
    for every sparse member of the bucket at once (where :func:`eligible`)."""
    buffer, plan, counters, world = call.buffer, call.plan, call.counters, ctx.world_size
    vdtype = ctx.vdtype(buffer)
    layout = SketchLayout.of(plan, tuple(ks), typing.cast(SketchCompressor, ctx.compressor), buffer.device)
    bad = nonfinite_members(call)
    inputs = _sparse_parts(buffer, plan, layout)
    if ctx.error_feedback:
        p = ctx.memory.flat(residual_layout(ctx, plan, buffer), buffer.device)
        assert p is not None  # eligible: the residuals live with the bucket
        views = layout.residual_views.of(p)
        ps = add_to_residuals(views, inputs, bad)
    else:
        p, views, ps = buffer, inputs, inputs
    if call.observe is not None:  # as in select_sorted: every rank observes every member
        for m, pm in zip(plan.sparse_members, ps, strict=True):
            call.observe(call.step, plan.label, m.name, pm)
    x = torch.cat(views).to(torch.float32)
    skipped = [span for span, b in zip(layout.spans, bad, strict=True) if b] if bad is not None else []
    for q0, d, _, _, _ in skipped:  # sketch nothing there: the summed tables stay finite, every rank agrees
        x[q0 : q0 + d].zero_()
    # reused (no page faults of a fresh allocation); one per bucket, as update mode's rounds overlap
    tables = scratch(f"patterns.sketch_tables.{plan.label}", layout.tables, torch.float32, buffer.device).zero_()
    hashes, gen = sketch_tables(ctx, call, layout, x, tables)
    del x
    first_round = ctx.comm.all_reduce(tables, counters)
    yield  # the other buckets' first rounds are issued meanwhile
    wait(first_round)  # on this thread: see SketchPattern
    n = layout.numel
    wide = scratch("sketch.wide", 2 * layout.unfold.numel(), torch.float32, buffer.device)
    positive, negative = wide.chunk(2)
    torch.index_select(tables, 0, layout.unfold, out=positive)  # the summed tables, doubled and signed
    torch.neg(positive, out=negative)
    estimates = [wide.index_select(0, at) for at in _buckets(layout, hashes)]
    a = scratch("sketch.magnitudes", n + 1, torch.float32, buffer.device)
    torch.abs(median_of_rows(estimates), out=a[:n])
    a[n:].fill_(-1.0)  # what the shortlist's padding points at: below every magnitude
    del estimates
    q = torch.arange(n, dtype=torch.int32, device=buffer.device)
    cand = _candidates(layout, a, q, gen).add_(layout.cand_shift)  # bucket offsets
    values = quantize(p[cand], vdtype)
    for _, _, c, first, _ in skipped:  # NaN from a non-finite input: every rank skips the step alike
        values[first : first + c].fill_(float("nan"))
    counters.sent_numel += sum(ks)
    issued = futures(ctx.comm.all_reduce(values, counters))

    @functools.cache
    def pick() -> tuple[Tensor, Tensor]:
        """Per member the k largest ``|sums|``: bucket offsets, sums."""
        bits = values.to(torch.float32).abs().view(torch.int32)
        key = layout.cand_base - bits  # member ascending, then magnitude descending
        chosen = torch.sort(key).indices[layout.pick_slots]
        return cand[chosen], values[chosen]

    def settle_residuals() -> None:  # what this rank contributed at the kept coordinates
        if not ctx.error_feedback:
            return
        at, _ = pick()
        if bad is not None:
            keep = [not b for (_, _, _, _, k), b in zip(layout.spans, bad, strict=True) for _ in range(k)]
            at = at[torch.tensor(keep, device=at.device)]
        exact = p[at]
        keep_unsent(p, at, exact, quantize(exact, vdtype), coded=False)

    def apply(out: Tensor) -> None:
        at, sums = pick()
        out.index_add_(0, at, sums.to(out.dtype), alpha=1.0 / world)

    return Pending(issued, apply, settle=settle_residuals)
