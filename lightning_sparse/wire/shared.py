"""Random-k of every sparse member of a bucket at once, in a fixed number of operators, no host read.

Every sparse member's ``k`` coordinates come from one draw
(:func:`~lightning_sparse.compressors.randomk.draw_subsets`) of (seed, step, parameter key, numel, k)
alone: the same on every rank and as :meth:`RandomK.select <lightning_sparse.compressors.RandomK.select>`,
whatever the bucket's layout. ``p = g + e`` and ``sent + e_new == p`` run on the bucket's flat residual
(offloaded residuals member by member). A non-finite input sends NaN and keeps its residual.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse._utils import RegionViews
from lightning_sparse.compressors.randomk import SubsetLayout, draw_subsets
from lightning_sparse.wire.batched import residual_layout, select_values
from lightning_sparse.wire.context import BucketCall, BucketPlan, WireContext
from lightning_sparse.wire.message import SparseSpace, quantize
from lightning_sparse.wire.select import Selection, nonfinite_members, select_sorted

__all__ = ["SharedLayout", "add_to_residuals", "select_shared"]


@dataclass(frozen=True)
class SharedLayout:
    """What drawing one bucket's random-k needs, made once per (plan, ks, device).

    Example:
        >>> from lightning_sparse.wire.context import Member
        >>> plan = BucketPlan((Member("w", 1, 0, 64, True), Member("b", 2, 64, 4, False)), 68, "w, b")
        >>> SharedLayout.of(plan, (3,), torch.device("cpu")).subsets.picks.numel()
        3
    """

    subsets: SubsetLayout  # the sparse members' candidates, buffer order
    space_order: Tensor | None  # the picks from buffer order into sparse-space order (None: the same)
    space_shift: Tensor  # sparse-space coordinate minus bucket offset, per pick (space order)
    residual_views: RegionViews  # the sparse members' regions of the flat residual, buffer order
    input_views: RegionViews  # and of the bucket's input
    small_views: RegionViews  # the small tensors' regions of the flat residual
    space_members: tuple[int, ...]  # the sparse members in space order
    space_ks: tuple[int, ...]  # and their k
    pick_offset: Tensor  # each pick's member's bucket offset (space order)
    names: tuple[str, ...]  # the sparse members' names, buffer order

    @staticmethod
    @functools.lru_cache(maxsize=64)  # few: a layout holds tensors as long as its picks
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
        regions = tuple((m.offset, m.numel) for m in sparse)
        return SharedLayout(
            subsets=subsets,
            space_order=None if order == sorted(order) else torch.tensor(order, dtype=torch.int64, device=device),
            space_shift=torch.tensor(shift, dtype=torch.int64, device=device),
            residual_views=RegionViews(regions),
            input_views=RegionViews(regions),
            small_views=RegionViews(tuple((m.offset, m.numel) for m in plan.dense_members)),
            space_members=space.members,
            space_ks=tuple(ks[i] for i in space.members),
            pick_offset=torch.tensor([sparse[i].offset for i in space.members for _ in range(ks[i])], device=device),
            names=tuple(m.name for m in sparse),
        )


def select_shared(ctx: WireContext, call: BucketCall, ks: list[int], vdtype: torch.dtype) -> Selection:
    """:func:`~lightning_sparse.wire.select.select_sorted` (with ``settle``) for the shared pattern:
    every sparse member at once where the compressor is random-k, each picking what it picks by itself."""
    buffer, plan = call.buffer, call.plan
    sparse = plan.sparse_members
    if ctx.at_once != "randomk" or not sparse:
        return select_sorted(ctx, call, ks, vdtype, settle=True)
    layout = SharedLayout.of(plan, tuple(ks), buffer.device)
    at = draw_subsets(layout.subsets, ctx.seed, call.step)  # bucket offsets, buffer order
    if layout.space_order is not None:
        at = at.index_select(0, layout.space_order)
    coords = at + layout.space_shift
    bad = nonfinite_members(call)  # the one host read, in gradient mode
    e, ps = _accumulate(ctx, call, layout, bad)
    if call.observe is not None:  # as select_sorted: every member's p, in space order
        ps = ps or (layout.residual_views.of(e) if e is not None else _inputs(call, layout))
        for i in layout.space_members:
            call.observe(call.step, plan.label, sparse[i].name, ps[i])
    if e is not None:
        if bad is None:
            exact, sent = select_values(e, at, vdtype, keep=True)
            if ctx.momentum_correction:
                _mask_velocity(ctx, layout, _local(layout, at), bad)
            return Selection(coords, exact, sent, [], flat=e, at=at)
        exact = e[at]  # a member whose input is not finite: one by one below
    elif not call.sources and not ctx.error_feedback:  # p is the input
        exact = buffer[at]
    else:  # offloaded residuals, or a substituted input without error feedback
        ps = ps or _inputs(call, layout)
        exact = torch.cat([ps[i][idx] for i, idx in zip(layout.space_members, _local(layout, at), strict=True)])
    sent = quantize(exact, vdtype)
    if bad is not None:  # the same message shape, NaN values: every rank skips the step alike
        sent = sent.clone() if sent is exact else sent
        nan = torch.full((1,), float("nan"), device=sent.device).to(vdtype)
        for i, part in zip(layout.space_members, sent.split(layout.space_ks), strict=True):
            if bad[i]:
                part.copy_(nan.expand_as(part))
    local = _local(layout, at) if ctx.error_feedback or ctx.momentum_correction else []
    if ctx.error_feedback:
        _keep_unsent(ctx, layout, local, exact, sent, bad)
    if ctx.momentum_correction:
        _mask_velocity(ctx, layout, local, bad)
    kept = ps if ps is not None and ctx.error_feedback else [None] * len(sparse)
    residual = [None if bad and bad[i] else p for i, p in enumerate(kept)]
    return Selection(coords, exact, sent, residual, flat=e, at=None if e is None else at)


def _inputs(call: BucketCall, layout: SharedLayout) -> list[Tensor]:
    """What is compressed of each sparse member (buffer order)."""
    return [call.input_of(m) for m in call.plan.sparse_members] if call.sources else layout.input_views.of(call.buffer)


def _accumulate(
    ctx: WireContext, call: BucketCall, layout: SharedLayout, bad: list[bool] | None
) -> tuple[Tensor | None, list[Tensor] | None]:
    """``p = g + e`` of every sparse member: the bucket's flat residual (None without error feedback or
    when offloaded) and, where they were made, each member's ``p`` (its input where it is not finite)."""
    buffer, plan = call.buffer, call.plan
    if not ctx.error_feedback:
        return None, None
    regions = residual_layout(ctx, plan, buffer)
    e = ctx.memory.flat(regions, buffer.device)
    if e is not None and bad is None and not call.sources and regions is plan.residual_layout:
        # one add for the whole bucket, then clear the small tensors' regions (they hold no residual)
        e.add_(buffer)
        if plan.dense_members:
            torch._foreach_zero_(layout.small_views.of(e))
        return e, None
    inputs = _inputs(call, layout)
    if e is None:  # offloaded: each residual staged on the device
        members = enumerate(zip(plan.sparse_members, inputs, strict=True))
        return None, [g if bad and bad[i] else ctx.memory.accumulate(m.name, g) for i, (m, g) in members]
    return e, add_to_residuals(layout.residual_views.of(e), inputs, bad)


def add_to_residuals(views: list[Tensor], inputs: list[Tensor], bad: list[bool] | None) -> list[Tensor]:
    """Add each member's input to its residual's view, but where the input is not finite (the residual stays
    as it was); returns each member's ``p``: the view, or the input where it is not finite."""
    if bad is None:
        torch._foreach_add_(views, inputs)
        return views
    for v, g, b in zip(views, inputs, bad, strict=True):
        if not b:
            v.add_(g)
    return [g if b else v for v, g, b in zip(views, inputs, bad, strict=True)]


def _local(layout: SharedLayout, at: Tensor) -> list[Tensor]:
    """Each member's picks (bucket offsets ``at``) as positions within it, in space order."""
    return list((at - layout.pick_offset).split(layout.space_ks))


def _keep_unsent(
    ctx: WireContext, layout: SharedLayout, local: list[Tensor], exact: Tensor, sent: Tensor, bad: list[bool] | None
) -> None:
    """After ``exact`` travelled as ``sent``, each finite member's residual keeps the rest."""
    parts = zip(layout.space_members, local, exact.split(layout.space_ks), sent.split(layout.space_ks), strict=True)
    for i, idx, values, q in parts:
        if not (bad and bad[i]):
            remainder = None if q.dtype == values.dtype else values - q.to(values.dtype)
            ctx.memory.keep_unsent(layout.names[i], idx, remainder)


def _mask_velocity(ctx: WireContext, layout: SharedLayout, local: list[Tensor], bad: list[bool] | None) -> None:
    """Momentum correction: the momenta forget what was sent."""
    for i, idx in zip(layout.space_members, local, strict=True):
        if not (bad and bad[i]):
            ctx.velocity.mask(layout.names[i], idx)
