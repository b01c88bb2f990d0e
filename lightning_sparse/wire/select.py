"""What a bucket's members send: the coordinates a compressor picks, and the small tensors whole.

Selection with error feedback serves every pattern that picks coordinates; the small tensors go in one message."""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_sparse._utils import all_finite, scratch
from lightning_sparse.wire import batched, quant
from lightning_sparse.wire.comm import Issued, futures
from lightning_sparse.wire.context import BucketCall, BucketPlan, Member, Pending, WireContext
from lightning_sparse.wire.message import SparseSpace, quantize


def flush_residuals(ctx: WireContext, call: BucketCall, members: tuple[Member, ...]) -> None:
    """Add any residual into the bucket before a dense send, so nothing stays behind unsent."""
    memory = ctx.memory
    held = memory.held([m.name for m in members]) if ctx.error_feedback else {}
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
                ctx.memory.keep_unsent(m.name, idx, batched.unsent(values, q, coded=False))
            if ctx.momentum_correction:
                ctx.velocity.mask(m.name, idx)
        coords.append(idx + start if start else idx)
        exact.append(values)
        sent.append(q)
        residual.append(p if ctx.error_feedback else None)
    return Selection(torch.cat(coords), torch.cat(exact), torch.cat(sent), residual)


def settle(ctx: WireContext, call: BucketCall, space: SparseSpace, sel: Selection, accepted: Tensor) -> None:
    """Take the coordinates at positions ``accepted`` of the selection out of the residuals."""
    coded = ctx.value_bits is not None
    if sel.flat is not None and sel.at is not None:  # selected at once
        batched.keep_unsent(sel.flat, sel.at[accepted], sel.exact[accepted], sel.sent[accepted], coded)
        return
    for i, part, idx in space.by_member(sel.coords[accepted]):
        if sel.residual[i] is None and ctx.error_feedback:
            continue  # non-finite input: the residual keeps its previous value
        m = call.plan.sparse_members[space.members[i]]
        if ctx.error_feedback:
            exact, sent = sel.exact[accepted[part]], sel.sent[accepted[part]]
            ctx.memory.keep_unsent(m.name, idx, batched.unsent(exact, sent, coded))
        if ctx.momentum_correction:
            ctx.velocity.mask(m.name, idx)


def launch_small(ctx: WireContext, call: BucketCall, members: tuple[Member, ...]) -> Pending:
    """Flush the residuals of ``members`` (a sparse bucket's small tensors) into them and launch their send."""
    if not members:
        return Pending([], lambda out: None)
    buffer, bits, world = call.buffer, ctx.value_bits, ctx.world_size
    key = call.plan if members is call.plan.dense_members else members
    views = _member_views(key, buffer.device)
    at = views.positions
    coded = bits is not None and quant.coded_members_pay(world, at.numel(), bits, buffer.element_size())
    if coded:
        at_once = _launch_coded_at_once(ctx, call, members, at)
        if at_once is not None:
            return at_once
    flush_residuals(ctx, call, members)
    message = views.messages.get(buffer.dtype)
    if message is None:
        message = views.messages[buffer.dtype] = torch.empty(at.numel(), dtype=buffer.dtype, device=buffer.device)
    values = torch.index_select(buffer, 0, at, out=message)  # one operator for all of them
    call.counters.sent_numel += values.numel()
    if coded:
        # coded, all-gathered (codes of different scales do not add up in an all-reduce), each rank keeping its
        # rounding error in its residuals: sent + e_new == g + e_old exactly; a non-finite member keeps its residual
        values = values.clone()

        def keep(sent: Tensor) -> None:
            if not ctx.error_feedback:
                return
            pos = 0
            for m in members:
                exact, got = values[pos : pos + m.numel].float(), sent[pos : pos + m.numel]
                pos += m.numel
                if call.inputs_finite or all_finite(exact):  # else flush_residuals kept the residual as it was
                    ctx.memory.accumulate(m.name, quant.remainder(exact, got))

        return _launch_coded(ctx, call, at, values, keep)
    issued = futures(ctx.comm.all_reduce(values, call.counters))

    def apply(out: Tensor) -> None:
        values.div_(world)
        at = _member_views(key, out.device).positions
        if out.dtype == values.dtype:
            out.index_add_(0, at, values)  # each position once: deterministic
        else:  # a bfloat16 model: the sum in the values' dtype, rounded once (as an add of mixed dtypes)
            out.index_copy_(0, at, out.index_select(0, at).to(values.dtype).add_(values).to(out.dtype))

    return Pending(issued, apply)


def all_gather_message(ctx: WireContext, call: BucketCall, message: Tensor, tag: str) -> tuple[Tensor, list[Issued]]:
    """All-gather every rank's ``message`` (counted): the gathered bytes in rank order (in the bucket's buffer
    ``tag``, made once: a bucket's exchange is applied before its next starts), and the futures."""
    world = ctx.world_size
    if world <= 1:
        ctx.comm.all_gather(message, message, call.counters)  # counted; nothing crosses the wire
        return message, []
    gathered = scratch(f"{tag}.{call.plan.label}", world * message.numel(), torch.uint8, message.device)
    return gathered, futures(ctx.comm.all_gather(gathered, message, call.counters))


@dataclass
class _MemberViews:
    """A bucket's small tensors on one device: their coordinates in the bucket (int64, message order), and a
    message buffer per dtype (reused: a bucket's exchange is applied before its next starts)."""

    positions: Tensor
    messages: dict[torch.dtype, Tensor] = field(default_factory=dict)


@functools.lru_cache(maxsize=1024)
def _member_views(members: BucketPlan | tuple[Member, ...], device: torch.device) -> _MemberViews:
    """The views of ``members``; a plan stands for its small tensors (cheaper to hash: its hash is cached)."""
    if isinstance(members, BucketPlan):
        members = members.dense_members
    return _MemberViews(torch.cat([torch.arange(m.offset, m.offset + m.numel) for m in members]).to(device))


def _launch_coded_at_once(
    ctx: WireContext, call: BucketCall, members: tuple[Member, ...], at: Tensor
) -> Pending | None:
    """The small tensors' coded send (``at``: their coordinates) on the bucket's flat residual; None (nothing done)
    without error feedback, for a buffer that is not float32, offloaded residuals or a non-finite value."""
    buffer = call.buffer
    if not ctx.error_feedback or buffer.dtype != torch.float32 or ctx.memory.home is not None:
        return None
    layout = batched.residual_layout(ctx, call.plan, buffer)
    named = {name for name, _ in layout if name is not None}
    if any(m.name not in named for m in members):
        return None
    values = buffer[at]
    if not call.inputs_finite and not all_finite(values):
        return None
    e = ctx.memory.flat(layout, buffer.device)
    if e is None:
        return None
    values.add_(e[at])  # flushed: g + e
    call.counters.sent_numel += values.numel()

    def keep(sent: Tensor) -> None:
        e.index_copy_(0, at, quant.remainder(values, sent))  # sent + e_new == g + e_old, exactly

    return _launch_coded(ctx, call, at, values, keep)


def _launch_coded(
    ctx: WireContext, call: BucketCall, at: Tensor, values: Tensor, keep: Callable[[Tensor], None]
) -> Pending:
    """Code ``values`` (the bucket's coordinates ``at``) in ``value_bits``, ``keep(sent)`` the rounding error and
    all-gather the codes; the average is added at ``at`` in rank order (identical bits on every rank)."""
    bits = typing.cast(int, ctx.value_bits)
    world, n = ctx.world_size, values.numel()
    message, sent = quant.pack(values, bits)
    keep(sent)
    gathered, issued = all_gather_message(ctx, call, message, "small.received")

    def apply(out: Tensor) -> None:
        total = out[at]
        parts = quant.unpack_rows(gathered.view(world, message.numel()), n, bits).to(out.dtype)
        for r in range(world):  # in rank order, as into ``out`` itself: identical bits on every rank
            total.add_(parts[r], alpha=1.0 / world)
        out.index_copy_(0, at, total)

    return Pending(issued, apply)
