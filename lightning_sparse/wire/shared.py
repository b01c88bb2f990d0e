"""Random-k of every sparse member of a bucket at once, in a fixed number of operators, no host read.

Every sparse member's ``k`` coordinates come from one draw
(:func:`~lightning_sparse.compressors.randomk.draw_subsets`), a function of (seed, step, parameter key,
numel, k) alone: the same on every rank, the same as :meth:`RandomK.select
<lightning_sparse.compressors.RandomK.select>`, and independent of the bucket's layout (which DDP
changes after its first step and on resume). ``p = g + e`` and the residual update
(``sent + e_new == p`` exactly) then run on the bucket's flat residual. A bucket with a non-finite
input, momentum correction or offloaded residuals goes one member at a time, at the same coordinates.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse._utils import RegionViews, all_finite
from lightning_sparse.compressors import CompressContext, Compressor
from lightning_sparse.compressors.randomk import SubsetLayout, draw_subsets
from lightning_sparse.wire.batched import residual_layout, select_values
from lightning_sparse.wire.context import BucketCall, BucketPlan, WireContext
from lightning_sparse.wire.message import SparseSpace, quantize
from lightning_sparse.wire.select import Selection, select_sorted

__all__ = ["SharedLayout", "eligible", "select_shared"]


def eligible(ctx: WireContext, call: BucketCall) -> bool:
    """Whether ``call``'s sparse members are drawn at once: a random-k compressor and a sparse member.

    Example:
        >>> from lightning_sparse.compressors import RandomK, TopK
        >>> from lightning_sparse.wire.stats import Counters
        >>> from lightning_sparse.wire.context import Member
        >>> call = BucketCall(torch.zeros(64), BucketPlan((Member("w", 1, 0, 64, True),), 64, "w"), 0, Counters())
        >>> [eligible(WireContext(c, True, 0.0, None, 0, "auto", True, None, True), call) for c in (RandomK(), TopK())]
        [True, False]
    """
    return ctx.compressor.selects_at_once("randomk") and bool(call.plan.sparse_members)


@dataclass(frozen=True)
class SharedLayout:
    """What drawing one bucket's random-k needs, made once per (plan, ks, device).

    Example:
        >>> from lightning_sparse.wire.context import Member
        >>> plan = BucketPlan((Member("w", 1, 0, 64, True), Member("b", 2, 64, 4, False)), 68, "w, b")
        >>> SharedLayout.of(plan, (3,), torch.device("cpu")).subsets.count
        3
    """

    subsets: SubsetLayout  # the sparse members' candidates, buffer order
    space_order: Tensor | None  # the picks from buffer order into sparse-space order (None: the same)
    space_shift: Tensor  # sparse-space coordinate minus bucket offset, per pick (space order)
    residual_views: RegionViews  # the sparse members' regions of the flat residual, buffer order
    input_views: RegionViews  # and of the bucket's input
    small_views: RegionViews  # the small tensors' regions of the flat residual
    spans: tuple[tuple[int, int, int, int, int], ...]  # space order: (key, numel, k, first pick, offset)

    @staticmethod
    @functools.lru_cache(maxsize=64)  # a layout holds about 100 bytes per coordinate it picks
    def of(plan: BucketPlan, ks: tuple[int, ...], device: torch.device) -> SharedLayout:
        sparse = plan.sparse_members
        space = SparseSpace.of(plan)
        ks = tuple(min(k, m.numel) for m, k in zip(sparse, ks, strict=True))
        subsets = SubsetLayout.of(tuple((m.key, m.offset, m.numel, k) for m, k in zip(sparse, ks, strict=True)), device)
        firsts = [sum(ks[:i]) for i in range(len(ks))]  # each member's first pick, buffer order
        order = [firsts[i] + j for i in space.members for j in range(ks[i])]
        shift = [
            s - o for i, s, o in zip(space.members, space.starts, space.offsets, strict=True) for _ in range(ks[i])
        ]
        spans, pos = [], 0
        for i in space.members:
            spans.append((sparse[i].key, sparse[i].numel, ks[i], pos, sparse[i].offset))
            pos += ks[i]
        regions = tuple((m.offset, m.numel) for m in sparse)
        return SharedLayout(
            subsets=subsets,
            space_order=None if order == sorted(order) else torch.tensor(order, dtype=torch.int64, device=device),
            space_shift=torch.tensor(shift, dtype=torch.int64, device=device),
            residual_views=RegionViews(regions),
            input_views=RegionViews(regions),
            small_views=RegionViews(tuple((m.offset, m.numel) for m in plan.dense_members)),
            spans=tuple(spans),
        )


def select_shared(ctx: WireContext, call: BucketCall, ks: list[int], vdtype: torch.dtype) -> Selection:
    """:func:`~lightning_sparse.wire.select.select_sorted` (with ``settle``) for the shared pattern:
    every sparse member at once where :func:`eligible`.

    Example:
        >>> from lightning_sparse.compressors import RandomK
        >>> from lightning_sparse.wire.stats import Counters
        >>> from lightning_sparse.wire.context import Member
        >>> plan = BucketPlan((Member("w", 1, 0, 1000, True),), 1000, "w")
        >>> ctx = WireContext(RandomK(), True, 0.0, None, 0, "auto", True, None, True)
        >>> call = BucketCall(torch.randn(1000), plan, 5, Counters())
        >>> sel = select_shared(ctx, call, [10], torch.float32)
        >>> torch.equal(sel.coords, RandomK().select(call.buffer, 10, ctx.compress_context(5, plan.members[0])))
        True
    """
    if not eligible(ctx, call):
        return select_sorted(ctx, call, ks, vdtype, settle=True)
    buffer, plan = call.buffer, call.plan
    layout = SharedLayout.of(plan, tuple(ks), buffer.device)
    at = draw_subsets(layout.subsets, ctx.seed, call.step)  # bucket offsets, buffer order
    if layout.space_order is not None:
        at = at.index_select(0, layout.space_order)
    whole = not ctx.momentum_correction and not call.sources and (not ctx.error_feedback or ctx.memory.home is None)
    if whole and (call.inputs_finite or all_finite(buffer)):  # the one host read, in gradient mode
        call.inputs_finite = True  # small tensors included: they need not check again
        return _at_once(ctx, call, layout, at, vdtype)
    # one member at a time, at the coordinates drawn
    picks = {(key, numel, k): at[pos : pos + k] - offset for key, numel, k, pos, offset in layout.spans}
    return select_sorted(dataclasses.replace(ctx, compressor=_Drawn(picks)), call, ks, vdtype, settle=True)


def _at_once(ctx: WireContext, call: BucketCall, layout: SharedLayout, at: Tensor, vdtype: torch.dtype) -> Selection:
    """``p`` at the bucket offsets ``at`` (sparse-space order), the residuals settled."""
    buffer, plan = call.buffer, call.plan
    coords = at + layout.space_shift
    e = None
    if ctx.error_feedback:
        regions = residual_layout(ctx, plan, buffer)
        e = ctx.memory.flat(regions, buffer.device)
        assert e is not None  # residuals that live with the bucket (select_shared)
        if regions is plan.residual_layout:
            # one add for the whole bucket, then clear the small tensors' regions (they hold no residual)
            e.add_(buffer)
            if plan.dense_members:
                torch._foreach_zero_(layout.small_views.of(e))
        else:
            torch._foreach_add_(layout.residual_views.of(e), layout.input_views.of(buffer))
    if call.observe is not None:  # as select_sorted: every member's p, in space order
        p = layout.residual_views.of(e) if e is not None else layout.input_views.of(buffer)
        for i in SparseSpace.of(plan).members:
            call.observe(call.step, plan.label, plan.sparse_members[i].name, p[i])
    if e is None:  # no error feedback: p is the input, and nothing stays behind
        exact = buffer[at]
        return Selection(coords, exact, quantize(exact, vdtype), [None] * len(plan.sparse_members))
    exact, sent = select_values(e, at, vdtype, keep=True)
    return Selection(coords, exact, sent, [], flat=e, at=at)


class _Drawn(Compressor):
    """The coordinates drawn for a bucket's members, by (key, numel, k), for the per-tensor selection."""

    name = "randomk"
    pattern = "shared"

    def __init__(self, picks: dict[tuple[int, int, int], Tensor]) -> None:
        self._picks = picks

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        return self._picks[(ctx.key, p.numel(), k)]

    __eq__ = object.__eq__
    __hash__ = object.__hash__
