"""The small tensors of a sparse bucket (below ``min_numel``): sent whole, beside the selected values.

One message for all of them: all-reduced as they are or, with ``value_bits``, coded and all-gathered
where that moves fewer bytes (:func:`~lightning_sparse.wire.quant.coded_members_pay`).
"""

from __future__ import annotations

import functools
import typing

import torch
from torch import Tensor

from lightning_sparse._utils import RegionViews, all_finite, scratch
from lightning_sparse.wire import batched, quant
from lightning_sparse.wire.comm import Issued, futures
from lightning_sparse.wire.context import BucketCall, BucketPlan, Member, Pending, WireContext
from lightning_sparse.wire.select import flush_residuals

__all__ = ["all_gather_message", "launch_small"]


def launch_small(ctx: WireContext, call: BucketCall, members: tuple[Member, ...]) -> Pending:
    """Flush the residuals of ``members`` (a sparse bucket's small tensors) into them and launch their send."""
    if not members:
        return Pending([], lambda out: None)
    views = _member_views(call.plan, members)
    bits = ctx.value_bits
    world = ctx.world_size
    coded = bits is not None and quant.coded_members_pay(world, views.numel, bits, call.buffer.element_size())
    if coded:
        at_once = _launch_coded_at_once(ctx, call, members)
        if at_once is not None:
            return at_once
    flush_residuals(ctx, call, members)
    buffer = call.buffer
    # one operator for all of them, through their positions
    values = torch.index_select(buffer, 0, views.positions(buffer.device), out=views.message(buffer))
    call.counters.sent_numel += values.numel()
    if coded:
        return _launch_coded_members(ctx, call, members, values.clone())
    issued = futures(ctx.comm.all_reduce(values, call.counters))

    def apply(out: Tensor) -> None:
        values.div_(world)
        at = views.positions(out.device)
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


class _MemberViews:
    """A bucket's small tensors: their regions, their positions, and the message buffer (one per dtype,
    reused: a bucket's exchange is applied before its next starts)."""

    def __init__(self, members: tuple[Member, ...]) -> None:
        self.bucket = RegionViews(tuple((m.offset, m.numel) for m in members))
        self.numel = sum(m.numel for m in members)
        self._messages: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._positions: dict[torch.device, Tensor] = {}

    def message(self, like: Tensor) -> Tensor:
        key = (like.dtype, like.device)
        buf = self._messages.get(key)
        if buf is None:
            buf = self._messages[key] = torch.empty(self.numel, dtype=like.dtype, device=like.device)
        return buf

    def positions(self, device: torch.device) -> Tensor:
        """Their coordinates in the bucket, in message order (int64)."""
        found = self._positions.get(device)
        if found is None:
            ranges = [torch.arange(a, a + n) for a, n in self.bucket.regions]
            found = self._positions[device] = torch.cat(ranges).to(device)
        return found


def _member_views(plan: BucketPlan, members: tuple[Member, ...]) -> _MemberViews:
    """The views of ``members``, cached by the plan where they are its small tensors (cheaper to hash)."""
    if members is plan.dense_members:
        return _plan_views(plan)
    return _views_of(members)


@functools.lru_cache(maxsize=1024)
def _plan_views(plan: BucketPlan) -> _MemberViews:
    return _MemberViews(plan.dense_members)


@functools.lru_cache(maxsize=1024)
def _views_of(members: tuple[Member, ...]) -> _MemberViews:
    return _MemberViews(members)


def _launch_coded_at_once(ctx: WireContext, call: BucketCall, members: tuple[Member, ...]) -> Pending | None:
    """:func:`_launch_coded_members` on the bucket's flat residual, to the same bits; None (nothing done)
    without error feedback, for a buffer that is not float32, offloaded residuals or a non-finite value."""
    buffer = call.buffer
    if not ctx.error_feedback or buffer.dtype != torch.float32 or ctx.memory.home is not None:
        return None
    layout = batched.residual_layout(ctx, call.plan, buffer)
    named = {name for name, _ in layout if name is not None}
    if any(m.name not in named for m in members):
        return None
    views = _member_views(call.plan, members)
    at = views.positions(buffer.device)
    values = buffer[at]
    if not call.inputs_finite and not all_finite(values):
        return None
    e = ctx.memory.flat(layout, buffer.device)
    if e is None:
        return None
    values.add_(e[at])  # flushed: g + e
    call.counters.sent_numel += values.numel()
    bits = typing.cast(int, ctx.value_bits)
    world, n = ctx.world_size, values.numel()
    message, sent = quant.pack(values, bits)
    e.index_copy_(0, at, quant.remainder(values, sent))  # sent + e_new == g + e_old, exactly
    gathered, issued = all_gather_message(ctx, call, message, "small.received")

    def apply(out: Tensor) -> None:
        total = out[at]
        parts = quant.unpack_rows(gathered.view(world, message.numel()), n, bits).to(out.dtype)
        for r in range(world):  # in rank order, as into ``out`` itself: identical bits on every rank
            total.add_(parts[r], alpha=1.0 / world)
        out.index_copy_(0, at, total)

    return Pending(issued, apply)


def _launch_coded_members(ctx: WireContext, call: BucketCall, members: tuple[Member, ...], values: Tensor) -> Pending:
    """The small tensors of a sparse send with ``value_bits``: coded, all-gathered (codes of different
    scales do not add up in an all-reduce), each rank keeping its rounding error in its residuals
    (``sent + e_new == g + e_old`` exactly). A non-finite member keeps its residual."""
    bits = typing.cast(int, ctx.value_bits)
    world, n = ctx.world_size, values.numel()
    message, sent = quant.pack(values, bits)
    if ctx.error_feedback:
        pos = 0
        for m in members:
            exact, got = values[pos : pos + m.numel].float(), sent[pos : pos + m.numel]
            pos += m.numel
            if call.inputs_finite or all_finite(exact):  # else flush_residuals kept the residual as it was
                ctx.memory.accumulate(m.name, quant.remainder(exact, got))
    gathered, issued = all_gather_message(ctx, call, message, "small.received")

    def apply(out: Tensor) -> None:
        parts = quant.unpack_rows(gathered.view(world, message.numel()), n, bits)
        for r in range(world):  # in rank order: identical bits on every rank
            part = parts[r]
            pos = 0
            for m in members:
                out[m.offset : m.offset + m.numel].add_(part[pos : pos + m.numel].to(out.dtype), alpha=1.0 / world)
                pos += m.numel

    return Pending(issued, apply)
