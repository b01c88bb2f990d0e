"""Top-k of every sparse member of a bucket at once, in a fixed number of operators and one host read.

A threshold per member from a uniform sample of its ``|p|`` lets at least ``k`` entries into a shortlist sorted by
(member, magnitude); where the host read finds a member short or the shortlist full, the members are selected one by
one. A chunked compressor's rows take one ``torch.topk`` (:class:`ChunkRows`), no host read.
"""

from __future__ import annotations

import functools
import itertools
import math
import typing
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse._utils import RegionViews, all_finite, make_generator, mix_seed, scratch
from lightning_sparse.compressors.base import ChunkedCompressor
from lightning_sparse.compressors.topk import sample_rank
from lightning_sparse.wire import quant
from lightning_sparse.wire.context import BucketCall, BucketPlan, WireContext
from lightning_sparse.wire.message import SparseSpace, quantize

#: draws per member for its threshold; aim for ``_ABOVE`` draws above the true threshold
_DRAWS = (256, 4096)
_ABOVE = 32
#: the threshold sits this many standard deviations of the count above it low
_MARGIN = 4.0
#: the shortlist holds this many times the entries the thresholds are expected to pass
_SLACK = 1.5
_BITS = 0x7FFFFFFF
#: on a CPU, a bucket holding a tensor this large is selected one tensor at a time (a host read is free there)
CPU_ONE_BY_ONE = 1 << 20


def shortlist_sizes(numels: list[int], ks: list[int], ratio: float, bound: int) -> tuple[int, list[int], int]:
    """The draws per member for its threshold (``ratio``: the largest numel / k), each member's sample
    rank less one, and the shortlist's capacity (at most ``bound``) for the ``ks`` largest of each."""
    draws = min(_DRAWS[1], max(_DRAWS[0], math.ceil(_ABOVE * ratio)))
    ranks, shortlist = [], 0.0
    for d, k in zip(numels, ks, strict=True):
        j = sample_rank(draws, k, d, _MARGIN)
        ranks.append(j - 1)
        shortlist += min(d, d * j / draws + 1)
    return draws, ranks, min(bound, max(sum(ks), math.ceil(_SLACK * shortlist) + 64))


def residual_layout(ctx: WireContext, plan: BucketPlan, buffer: Tensor) -> tuple[tuple[str | None, int], ...]:
    """How a bucket's residuals lie in their flat tensor (:meth:`ErrorFeedback.flat
    <lightning_sparse.wire.memory.ErrorFeedback.flat>`): the sparse members', and the small tensors'
    where they travel coded (``value_bits``). Every part of the exchange asks here, so all see one tensor.

    Example:
        >>> from lightning_sparse.compressors import TopK
        >>> from lightning_sparse.wire.context import BucketPlan, Member
        >>> plan = BucketPlan((Member("w", 1, 0, 64, True), Member("b", 2, 64, 4, False)), 68, "w, b")
        >>> ctx = WireContext(TopK(), True, 0.0, None, 0, "auto", True, None, True)
        >>> residual_layout(ctx, plan, torch.zeros(68))
        (('w', 64), (None, 4))
    """
    bits = ctx.value_bits
    if bits is not None and plan.dense_members:
        small = sum(m.numel for m in plan.dense_members)
        if quant.coded_members_pay(ctx.world_size, small, bits, buffer.element_size()):
            return tuple((m.name, m.numel) for m in plan.members)
    return plan.residual_layout


def eligible(ctx: WireContext, call: BucketCall) -> str | None:
    """The rule (``"topk"``, ``"chunk"``) by which ``call``'s sparse members can be selected at once, with plain
    error feedback on residuals that live with the bucket (no momentum correction, observer, sources or
    offloading); None where they cannot."""
    plain = ctx.error_feedback and not ctx.momentum_correction and ctx.memory.home is None
    if not plain or call.observe is not None or call.sources or not call.plan.sparse_members:
        return None
    rule = ctx.at_once
    return rule if rule in ("topk", "chunk") else None


@dataclass
class BatchedLayout:
    """What the batched selection of one bucket needs, made once per (plan, ks, device)."""

    numel: int
    k: int
    capacity: int
    draws: int
    one_by_one_on_cpu: bool  # a member of at least CPU_ONE_BY_ONE elements
    deepest: int  # the largest sample rank, plus 1
    sizes: Tensor  # every member's numel, buffer order
    region_ends: Tensor  # cumulative ends of the members
    thresholds: Tensor  # per member: +inf for dense members (filled for the sparse ones each call)
    sparse_regions: Tensor  # the sparse members' positions among the members, buffer order
    ks: Tensor  # their k
    rank_col: Tensor  # the sample rank that estimates each one's k-th largest, minus 1 (S, 1)
    take_all: Tensor  # k >= numel: every entry
    draw_numel: Tensor  # (S, 1) numel, offset, for the draws
    draw_offset: Tensor
    local_k: Tensor  # position within its member of each of the K picks
    pick_member: Tensor  # the sparse member of each of the K picks (buffer order)
    space_order: Tensor  # the K picks from buffer order into sparse-space order
    space_shift: Tensor  # sparse-space coordinate minus bucket offset, per pick (space order)
    residual_views: RegionViews  # the sparse members' regions of the flat residual
    input_views: RegionViews  # and of the bucket's input
    space_members: tuple[tuple[int, int, int, int], ...]  # (sparse index, bucket offset, numel, k), space order

    @functools.cached_property
    def member_of(self) -> Tensor:
        """int32, per entry of the bucket: its member (made once: ``repeat_interleave`` on a GPU writes each
        member from one thread)."""
        members = torch.arange(self.sizes.numel(), dtype=torch.int32, device=self.sizes.device)
        return torch.repeat_interleave(members, self.sizes, output_size=self.numel)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(plan: BucketPlan, ks: tuple[int, ...], device: torch.device) -> BatchedLayout:
        sparse = plan.sparse_members
        space = SparseSpace.of(plan)
        regions = [i for i, m in enumerate(plan.members) if m.sparse]
        numels = [m.numel for m in sparse]
        ratio = max(d / max(k, 1) for d, k in zip(numels, ks, strict=True))
        draws, ranks, capacity = shortlist_sizes(numels, list(ks), ratio, plan.numel)
        total_k = sum(ks)
        # picks come member after member in buffer order; sparse space orders members by name
        firsts = [sum(ks[:i]) for i in range(len(ks))]
        order = [firsts[i] + j for i in space.members for j in range(ks[i])]
        starts = zip(space.members, space.starts, space.offsets, strict=True)
        shift = [s - o for i, s, o in starts for _ in range(ks[i])]

        def long(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return BatchedLayout(
            numel=plan.numel,
            k=total_k,
            capacity=capacity,
            draws=draws,
            one_by_one_on_cpu=max(numels) >= CPU_ONE_BY_ONE,
            deepest=max(ranks) + 1,
            sizes=long([m.numel for m in plan.members]),
            region_ends=long(list(itertools.accumulate(m.numel for m in plan.members))),
            thresholds=torch.full((len(plan.members),), math.inf, dtype=torch.float32, device=device),
            sparse_regions=long(regions),
            ks=long(list(ks)),
            rank_col=long(ranks).unsqueeze(1),
            take_all=torch.tensor([k >= d for d, k in zip(numels, ks, strict=True)], device=device),
            draw_numel=long(numels).unsqueeze(1),
            draw_offset=long([m.offset for m in sparse]).unsqueeze(1),
            local_k=long([j for k in ks for j in range(k)]),
            pick_member=torch.repeat_interleave(
                torch.arange(len(ks), device=device), long(list(ks)), output_size=total_k
            ),
            space_order=long(order),
            space_shift=long(shift),
            residual_views=RegionViews(tuple((m.offset, m.numel) for m in sparse)),
            input_views=RegionViews(tuple((m.offset, m.numel) for m in sparse)),
            space_members=tuple((i, sparse[i].offset, sparse[i].numel, ks[i]) for i in space.members),
        )


@dataclass
class BatchedSelection:
    """What :func:`batched_topk` picked: ``at``, bucket offsets in sparse-space order, ``coords`` the
    same in sparse space, ``residual`` the bucket's flat residual."""

    at: Tensor
    coords: Tensor
    residual: Tensor


def batched_topk(ctx: WireContext, call: BucketCall, ks: list[int], rule: str = "topk") -> BatchedSelection | None:
    """Accumulate ``p = g + e`` into the bucket's flat residual and pick every sparse member's top-``k``
    of ``|p|`` (``rule="chunk"``: every row's share, :class:`ChunkRows`). None, with nothing changed, where an
    input is not finite (the per-tensor path handles it)."""
    buffer = call.buffer
    layout = BatchedLayout.of(call.plan, tuple(ks), buffer.device)
    if not call.inputs_finite:
        if not all_finite(buffer):
            return None
        call.inputs_finite = True  # small tensors included: they need not check again
    e = ctx.memory.flat(residual_layout(ctx, call.plan, buffer), buffer.device)
    if e is None:
        return None
    torch._foreach_add_(layout.residual_views.of(e), layout.input_views.of(buffer))
    if layout.one_by_one_on_cpu and buffer.device.type == "cpu":
        # see CPU_ONE_BY_ONE; the chunked rule too: the same picks, without laying the rows out
        return BatchedSelection(at := _one_by_one(ctx, call, layout, e), at + layout.space_shift, e)
    if rule == "chunk":
        rows = ChunkRows.of(call.plan, tuple(ks), typing.cast(ChunkedCompressor, ctx.compressor), buffer.device)
        at = rows.picks(e).sort().values[layout.space_order]
        return BatchedSelection(at, at + layout.space_shift, e)
    n = layout.numel
    a = scratch("batched.abs", n + 1, torch.float32, buffer.device)
    torch.abs(e, out=a[:n])
    a[n:].fill_(-1.0)  # what the shortlist's padding points at: below every magnitude
    gen = make_generator(buffer.device, mix_seed(ctx.seed, 0xBA7C, ctx.rank, call.step, layout.numel, layout.k))
    draws = torch.randint(0, 1 << 62, (layout.draw_numel.numel(), layout.draws), generator=gen, device=buffer.device)
    draws.remainder_(layout.draw_numel).add_(layout.draw_offset)
    top = torch.topk(a[draws], layout.deepest, dim=1).values
    threshold = top.gather(1, layout.rank_col).squeeze(1)
    # zeros never pass (fewer than k non-zeros: the per-tensor path); k >= numel: all
    threshold = torch.where(layout.take_all, -1.0, threshold.clamp_min(torch.finfo(torch.float32).tiny))
    layout.thresholds.index_copy_(0, layout.sparse_regions, threshold)
    mask = torch.ge(a[:n], layout.thresholds.index_select(0, layout.member_of))
    ranked, starts, counts, passed = rank_shortlist(a, mask, layout.capacity, layout.region_ends, layout.sparse_regions)
    if bool((counts < layout.ks).any() | (passed > layout.capacity)):  # the one host read; rare
        at = _one_by_one(ctx, call, layout, e)
    else:
        at = ranked[starts.index_select(0, layout.pick_member).add_(layout.local_k)].sort().values[layout.space_order]
    return BatchedSelection(at, at + layout.space_shift, e)


@dataclass
class ChunkRows:
    """A bucket's sparse members as rows of ``chunk`` values, for a chunked compressor's picks in one ``torch.topk``;
    made once per (plan, ks, compressor, device).

    Each member's rows follow the last one's (its last row padded), so entry ``i`` of a member whose rows start at
    row ``r`` sits at ``r * chunk + i``; the small tensors' entries go past the rows, to ``spare`` slots.

    Example:
        >>> from lightning_sparse.compressors import ChunkTopK
        >>> from lightning_sparse.wire.context import BucketPlan, Member
        >>> plan = BucketPlan((Member("w", 1, 0, 10, True), Member("b", 2, 10, 2, False)), 12, "w, b")
        >>> rows = ChunkRows.of(plan, (5,), ChunkTopK(chunk=4), torch.device("cpu"))
        >>> e = torch.tensor([0.5, -3.0, 2.0, 0.1, 4.0, -0.2, 1.5, 0.3, -0.7, 0.9, 8.0, 9.0])
        >>> rows.rows, rows.width, rows.picks(e).sort().values.tolist()  # the small tensor (8, 9) is not a row
        (3, 2, [1, 2, 4, 6, 9])
    """

    rows: int
    chunk: int
    width: int  # picks a row takes from the topk (the largest share of any row)
    dest: Tensor  # int32, per entry of the bucket: its place in the rows (or a spare slot)
    row_start: Tensor  # (rows, 1): the bucket offset of each row's first value
    keep: Tensor | None  # the kept picks' positions among rows x width (None: all)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(plan: BucketPlan, ks: tuple[int, ...], compressor: ChunkedCompressor, device: torch.device) -> ChunkRows:
        chunk = compressor.chunk
        picks = [compressor.row_picks(m.numel, k) for m, k in zip(plan.sparse_members, ks, strict=True)]
        width = max(max(p) for p in picks)
        rows = sum(len(p) for p in picks)
        dest = torch.empty(plan.numel, dtype=torch.int32)
        starts: list[int] = []
        keep: list[int] = []
        row, spare = 0, rows * chunk
        sparse = iter(picks)
        for m in plan.members:
            if not m.sparse:
                dest[m.offset : m.offset + m.numel] = torch.arange(spare, spare + m.numel, dtype=torch.int32)
                spare += m.numel
                continue
            counts = next(sparse)
            dest[m.offset : m.offset + m.numel] = torch.arange(row * chunk, row * chunk + m.numel, dtype=torch.int32)
            for j, count in enumerate(counts):
                starts.append(m.offset + j * chunk)
                keep += range((row + j) * width, (row + j) * width + count)
            row += len(counts)
        kept = None if len(keep) == rows * width else torch.tensor(keep, dtype=torch.int64, device=device)
        row_start = torch.tensor(starts, dtype=torch.int64, device=device).unsqueeze(1)
        return ChunkRows(rows, chunk, width, dest.to(device), row_start, kept)

    def picks(self, e: Tensor) -> Tensor:
        """Bucket offsets of every row's largest ``|e|`` (``e``: the bucket's flat residual), member by member in
        buffer order, unsorted within a member."""
        size = self.rows * self.chunk
        a = scratch("batched.chunk_rows", size + e.numel(), torch.float32, e.device)
        a[:size].fill_(-1.0)  # the padding: below every |e| (the spare slots are never read)
        a.index_put_((self.dest,), torch.abs(e, out=scratch("batched.chunk_abs", e.numel(), torch.float32, e.device)))
        # sorted where a row keeps fewer than it picked: its first picks are its largest
        top = torch.topk(a[:size].view(self.rows, self.chunk), self.width, dim=1, sorted=self.keep is not None)
        at = top.indices.add_(self.row_start).view(-1)
        return at if self.keep is None else at.index_select(0, self.keep)


def rank_shortlist(
    a: Tensor, mask: Tensor, capacity: int, ends: Tensor, members: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The positions where ``mask`` holds (at most ``capacity``, no host read), ranked by member
    (``ends``: each member's end, ``members``: their numbers), then by magnitude ``a`` descending
    (non-negative float32, one entry past the mask for the padding to read). Returns the ranked
    positions, each member's start and count among them, and how many passed (over ``capacity``: cut short).

    Example:
        >>> a = torch.tensor([0.5, 2.0, 1.0, 3.0, -1.0])
        >>> ends, members = torch.tensor([2, 4]), torch.tensor([0, 1])
        >>> ranked, starts, counts, passed = rank_shortlist(a, a[:4] > 0.7, 4, ends, members)
        >>> ranked[:3].tolist(), starts.tolist(), counts.tolist(), int(passed)
        ([1, 3, 2], [0, 1], [1, 2], 3)
    """
    n = mask.numel()
    passed = mask.sum()
    idx = torch.nonzero_static(mask, size=capacity, fill_value=n).squeeze(1)
    region = torch.searchsorted(ends, idx, right=True)
    bits = a[idx].view(torch.int32).to(torch.int64)
    key = region.mul_(1 << 32).add_(_BITS).sub_(bits)  # member ascending, then magnitude descending
    key, order = torch.sort(key)
    ranked = idx[order]
    region = key.div_(1 << 32, rounding_mode="floor")
    starts = torch.searchsorted(region, members)
    counts = torch.searchsorted(region, members, right=True).sub_(starts)
    return ranked, starts, counts, passed


def _one_by_one(ctx: WireContext, call: BucketCall, layout: BatchedLayout, e: Tensor) -> Tensor:
    """The members' top-``k`` of the accumulated ``e``, one at a time, in sparse-space order."""
    compressor = ctx.compressor
    parts = []
    for i, offset, numel, k in layout.space_members:
        m = call.plan.sparse_members[i]
        idx = compressor.select(e[offset : offset + numel], k, ctx.compress_context(call.step, m))
        parts.append(idx.sort().values + offset)
    return torch.cat(parts)


def select_values(e: Tensor, at: Tensor, vdtype: torch.dtype, keep: bool) -> tuple[Tensor, Tensor]:
    """``p`` at the picks and the values as they travel; with ``keep`` the residual keeps the rest."""
    exact = e[at]
    sent = quantize(exact, vdtype)
    if sent is exact:
        sent = exact.clone()  # callers may change what travels (the split's codes)
    if keep:
        keep_unsent(e, at, exact, sent, coded=False)
    return exact, sent


def unsent(exact: Tensor, sent: Tensor, coded: bool) -> Tensor | None:
    """What a residual keeps where ``exact`` (``p``) travelled as ``sent``, so that ``sent + e_new == p`` exactly
    (``coded``: ``sent`` is what codes stand for); None: nothing."""
    if coded:
        return quant.remainder(exact, sent)
    return None if sent.dtype == exact.dtype else exact - sent.to(exact.dtype)


def keep_unsent(e: Tensor, at: Tensor, exact: Tensor, sent: Tensor, coded: bool, taken: Tensor | None = None) -> None:
    """Keep :func:`unsent` in the flat residual ``e`` at bucket offsets ``at``; with ``taken``, only at the picks
    where it holds (elsewhere ``e`` keeps all it had)."""
    rest = unsent(exact, sent, coded)
    if taken is not None:
        rest = torch.where(taken, torch.zeros_like(exact) if rest is None else rest, e[at])
    if rest is None:
        e.index_fill_(0, at, 0.0)
    else:
        e.index_copy_(0, at, rest)
