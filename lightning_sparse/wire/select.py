"""Selection with error feedback, for every pattern that picks coordinates."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse._utils import all_finite
from lightning_sparse.wire import batched, quant
from lightning_sparse.wire.context import BucketCall, Member, WireContext
from lightning_sparse.wire.message import SparseSpace, quantize


def flush_residuals(ctx: WireContext, call: BucketCall, members: tuple[Member, ...]) -> None:
    """Add any residual into the bucket before a dense send, so nothing stays behind unsent."""
    if not ctx.error_feedback:
        return
    memory = ctx.memory
    held = memory.held([m.name for m in members])
    if not held:
        return
    for m in members:
        if m.name in held:
            segment = call.segment(m)
            if not call.inputs_finite and not all_finite(segment):
                # sent as it is, so every rank skips the step; the residual stays unpoisoned
                call.counters.nonfinite_buckets = 1
                continue
            memory.accumulate(m.name, segment)
            sent = memory.flush(m.name, call.buffer.dtype)
            assert sent is not None
            segment.copy_(sent)


def nonfinite_members(call: BucketCall) -> list[bool] | None:
    """Which sparse members' inputs are not finite (None: all are; one host read where the bucket is).

    Example:
        >>> from lightning_sparse.wire.context import BucketPlan
        >>> from lightning_sparse.wire.stats import Counters
        >>> plan = BucketPlan((Member("w", 1, 0, 2, True), Member("v", 2, 2, 2, True)), 4, "w, v")
        >>> nonfinite_members(BucketCall(torch.tensor([0.0, 1.0, float("inf"), 2.0]), plan, 0, Counters()))
        [False, True]
    """
    if call.inputs_finite:
        return None
    if not call.sources and all_finite(call.buffer):
        call.inputs_finite = True  # small tensors included: they need not check again
        return None
    bad = [not all_finite(call.input_of(m)) for m in call.plan.sparse_members]
    if not any(bad):
        return None
    call.counters.nonfinite_buckets = 1
    return bad


@dataclass
class Selection:
    """A bucket's selected coordinates, sorted, before they cross the wire.

    ``coords``: sparse-space coordinates (int64, ascending); ``exact``: ``p`` there; ``sent``: the values
    as they travel; ``residual``: per sparse member in :class:`SparseSpace` order, the buffer holding
    ``p = g + e`` (None: no error feedback, or a non-finite input).
    """

    coords: Tensor
    exact: Tensor
    sent: Tensor
    residual: list[Tensor | None]
    #: selected at once: the bucket's flat residual, and the bucket offsets of ``coords``
    flat: Tensor | None = None
    at: Tensor | None = None


def select_sorted(ctx: WireContext, call: BucketCall, ks: list[int], vdtype: torch.dtype, settle: bool) -> Selection:
    """Select ``ks`` coordinates of each sparse member (error feedback included), sorted.

    With ``settle`` the residuals keep what is not sent (``sent + e_new == p``); without, all of ``p``, and
    the caller settles what was finally sent. A non-finite input sends NaN and keeps its residual.
    """
    rule = batched.eligible(ctx, call)
    if rule:
        picked = batched.batched_topk(ctx, call, ks, rule)
        if picked is not None:
            exact_, sent_ = batched.select_values(picked.residual, picked.at, vdtype, keep=settle)
            return Selection(picked.coords, exact_, sent_, [], flat=picked.residual, at=picked.at)
    compressor = ctx.compressor
    plan = call.plan
    space = SparseSpace.of(plan)
    coords: list[Tensor] = []
    exact: list[Tensor] = []
    sent: list[Tensor] = []
    residual: list[Tensor | None] = []
    for i, start in zip(space.members, space.starts, strict=True):
        m, k = plan.sparse_members[i], ks[i]
        g = call.input_of(m)
        cctx = ctx.compress_context(call.step, m)
        if not call.inputs_finite and not all_finite(g):
            # the same message shape, NaN values: every rank skips the step alike
            call.counters.nonfinite_buckets = 1
            if call.observe is not None:
                call.observe(call.step, plan.label, m.name, g)
            shared = compressor.pattern == "shared"
            idx = compressor.select(g, k, cctx).sort().values if shared else torch.arange(k, device=g.device)
            values = torch.full((k,), float("nan"), dtype=torch.float32, device=g.device)
            coords.append(idx + start)
            exact.append(values)
            sent.append(values.to(vdtype))
            residual.append(None)
            continue
        p = ctx.memory.accumulate(m.name, g) if ctx.error_feedback else g
        if call.observe is not None:
            call.observe(call.step, plan.label, m.name, p)
        idx = compressor.select(p, k, cctx)
        if idx.numel() != k:
            raise RuntimeError(f"{type(compressor).__name__}.select returned {idx.numel()} indices for k={k}")
        idx = idx.sort().values
        values = p[idx]
        q = quantize(values, vdtype)
        if settle:
            if ctx.error_feedback:
                ctx.memory.keep_unsent(m.name, idx, None if q.dtype == values.dtype else values - q.to(values.dtype))
            if ctx.momentum_correction:
                ctx.velocity.mask(m.name, idx)
        coords.append(idx + start if start else idx)
        exact.append(values)
        sent.append(q)
        residual.append(p if ctx.error_feedback else None)
    return Selection(torch.cat(coords), torch.cat(exact), torch.cat(sent), residual)


def settle(ctx: WireContext, call: BucketCall, space: SparseSpace, sel: Selection, accepted: Tensor) -> None:
    """Take the coordinates at positions ``accepted`` of the selection out of the residuals."""
    if sel.flat is not None and sel.at is not None:  # selected at once
        exact, sent = sel.exact[accepted], sel.sent[accepted]
        batched.keep_unsent(sel.flat, sel.at[accepted], exact, sent, coded=ctx.value_bits is not None)
        return
    coords = sel.coords[accepted]
    for i, part, idx in space.by_member(coords):
        if sel.residual[i] is None and ctx.error_feedback:
            continue  # non-finite input: the residual keeps its previous value
        m = call.plan.sparse_members[space.members[i]]
        if ctx.error_feedback:
            exact, sent = sel.exact[accepted[part]], sel.sent[accepted[part]]
            if ctx.value_bits is not None:
                # a chunk made non-finite by another member's value: these coordinates keep what they had
                ctx.memory.keep_unsent(m.name, idx, quant.remainder(exact, sent))
            else:
                rounded = sent.dtype != exact.dtype
                ctx.memory.keep_unsent(m.name, idx, exact - sent.to(exact.dtype) if rounded else None)
        if ctx.momentum_correction:
            ctx.velocity.mask(m.name, idx)
