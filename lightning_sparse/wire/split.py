"""The split exchange, after Ok-Topk's sparse all-reduce (Li and Hoefler, PPoPP 2022).

Each rank sends the owner of each block-cyclic region of the sparse space its pairs there (one all-to-all), every
owner keeps the largest sums, and the owners' choices are all-gathered; no host read."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse._utils import scratch
from lightning_sparse.wire.batched import keep_unsent
from lightning_sparse.wire.comm import Rounds, futures, wait
from lightning_sparse.wire.context import BY_COUNT, BucketCall, Pending, WireContext
from lightning_sparse.wire.message import MessageLayout, SparseSpace, quantize
from lightning_sparse.wire.select import select_sorted, settle
from lightning_sparse.wire.stats import ring_all_gather_bytes

#: blocks of this many coordinates go to the ranks in turn (odd: a power-of-two row length does not
#: keep one column on one owner)
SPLIT_BLOCK = 127
#: each rank may send an owner up to this many times its fair share (k / W) of coordinates
SPLIT_SLACK = 2.0
_MAGNITUDE_BITS = 0x7FFFFFFF


@dataclass(frozen=True)
class Regions:
    """Block-cyclic ownership of ``n`` coordinates among ``world`` ranks (the split exchange).

    Example:
        >>> import torch
        >>> r = Regions(n=1000, world=4, block=127)
        >>> s = torch.arange(1000)
        >>> owner = r.owner(s)
        >>> all(torch.equal(r.to_space(r.local(s[owner == j]), j), s[owner == j]) for j in range(4))
        True
        >>> r.sizes, r.largest
        ((254, 254, 254, 238), 254)
    """

    n: int
    world: int
    block: int = SPLIT_BLOCK

    @property
    def sizes(self) -> tuple[int, ...]:
        full, rest = divmod(self.n, self.block * self.world)
        return tuple(full * self.block + min(max(rest - j * self.block, 0), self.block) for j in range(self.world))

    @property
    def largest(self) -> int:
        return self.sizes[0]

    def owner(self, coords: Tensor) -> Tensor:
        return torch.div(coords, self.block, rounding_mode="floor") % self.world

    def local(self, coords: Tensor) -> Tensor:
        """Position within the owner's region (increasing with the coordinate)."""
        return torch.div(coords, self.block * self.world, rounding_mode="floor") * self.block + coords % self.block

    def to_space(self, local: Tensor, owner: int | Tensor) -> Tensor:
        """Coordinates of positions within ``owner``'s region (a tensor of owners broadcasts)."""
        return (
            torch.div(local, self.block, rounding_mode="floor") * self.world + owner
        ) * self.block + local % self.block


def split_capacities(n: int, k: int, world: int) -> tuple[int, int]:
    """Pairs per (rank, owner) chunk of the all-to-all, and per owner in the global selection."""
    largest = Regions(n, world).largest
    send = min(k, largest, max(1, math.ceil(SPLIT_SLACK * k / world)))
    keep = min(largest, world * send, max(1, math.ceil(k / world)))
    return send, keep


def split_layouts(
    n: int, k: int, world: int, vdtype: torch.dtype, compact: bool, value_bits: int | None = None
) -> tuple[MessageLayout, ...]:
    """The messages of the all-to-all and of the all-gather."""
    largest = Regions(n, world).largest
    return tuple(MessageLayout.of(largest, c, vdtype, compact, True, value_bits) for c in split_capacities(n, k, world))


def split_wire_bytes(
    world: int, n: int, k: int, vdtype: torch.dtype, compact: bool, value_bits: int | None = None
) -> float:
    """Bytes through each rank for the split exchange of ``k`` coordinates per rank out of ``n``."""
    if world <= 1:
        return 0.0
    first, second = split_layouts(n, k, world, vdtype, compact, value_bits)
    return (world - 1) * first.size + ring_all_gather_bytes(world, second.size)


def _keep_largest_per_owner(owner: Tensor, magnitude: Tensor, world: int, cap: int) -> Tensor:
    """Positions of the selection by owner, ``(world, cap)``: row ``j`` holds owner ``j``'s positions
    ascending, then ``owner.numel()``; the ``cap`` largest magnitudes (ties: the smaller position)."""
    count = owner.numel()
    # one sort by (owner, magnitude descending, position): non-negative floats' bits order as they do
    bits = magnitude.float().view(torch.int32).long()
    key, by = torch.sort(owner * (1 << 32) + (_MAGNITUDE_BITS - bits), stable=True)
    group = key.div_(1 << 32, rounding_mode="floor")
    first = torch.searchsorted(group, torch.arange(world, device=owner.device))
    rank = torch.arange(count, device=owner.device) - first[group]
    slot = torch.where(rank < cap, group * cap + rank, world * cap)  # the rest: a spare last slot
    table = torch.full((world * cap + 1,), count, dtype=torch.int64, device=owner.device)
    return table.scatter_(0, slot, by)[:-1].view(world, cap).sort(dim=1).values


def _owner_choice(local: Tensor, values: Tensor, end: int, keep: int) -> tuple[Tensor, Tensor]:
    """An owner's choice from what the ranks sent it (row ``r``: rank ``r``'s positions, ``end`` past
    its count, and their values): the ``keep`` largest sums (added in rank order; NaN the largest;
    ties to the smaller position). ``(positions ascending, then end; their sums, then 0)``."""
    local, order = torch.sort(local.view(-1), stable=True)  # by position, then rank: the padding last
    starts = torch.ones_like(local, dtype=torch.bool)
    torch.ne(local[1:], local[:-1], out=starts[1:])
    group = torch.cumsum(starts, 0).sub_(1)
    sums = torch.zeros(local.numel(), dtype=torch.float32, device=local.device)
    sums.index_add_(0, group, values.reshape(-1)[order].float())
    unique = torch.full_like(local, end).scatter_(0, group, local)  # each group's position, ascending
    magnitude = torch.where(unique < end, sums.abs().nan_to_num(nan=math.inf), -1.0)
    top = torch.sort(magnitude, descending=True, stable=True).indices[:keep].sort().values
    return unique[top], sums[top]


def launch_split(ctx: WireContext, call: BucketCall, ks: list[int], vdtype: torch.dtype) -> Rounds[Pending]:
    """Launch the split exchange of a gather-pattern bucket; it yields once its all-to-all is issued."""
    world, rank, buffer, counters = ctx.world_size, ctx.rank, call.buffer, call.counters
    device = buffer.device
    space = SparseSpace.of(call.plan)
    regions = Regions(space.numel, world)
    largest = regions.largest  # past every position in a region: the padding's, which sorts last
    bits = ctx.value_bits
    first, second = split_layouts(space.numel, sum(ks), world, vdtype, ctx.compact_indices, bits)
    sel = select_sorted(ctx, call, ks, vdtype, settle=False)
    picks = sel.coords.numel()
    magnitude = sel.exact.abs().nan_to_num(nan=math.inf)
    table = _keep_largest_per_owner(regions.owner(sel.coords), magnitude, world, first.capacity)
    placed = table < picks

    # stage 1: each owner gets this rank's pairs in its region (fixed-size chunks, one all-to-all)
    at = table.clamp(max=picks - 1)  # the padding reads the last pick; pack_rows ignores it
    sending = regions.local(sel.coords)[at]
    # the bucket's buffers, made once (its exchange is applied before its next starts)
    label = call.plan.label
    outgoing = scratch(f"split.outgoing.{label}", world * first.size, torch.uint8, device).view(world, first.size)
    outgoing, arriving = first.pack_rows(sending, sel.sent[at], placed.sum(1), outgoing)
    if bits is not None:  # what the owner receives is what the codes stand for
        padded = torch.cat([sel.sent, sel.sent.new_zeros(1)])  # the padding writes zeros to the spare
        sel.sent = padded.index_put_((table.view(-1),), arriving.view(-1))[:picks]
    incoming = scratch(f"split.incoming.{label}", outgoing.numel(), outgoing.dtype, device).view(outgoing.shape)
    # waited for on this thread, stage 2 issued right after (see SketchPattern)
    first_round = ctx.comm.all_to_all(incoming, outgoing, counters)
    # counted without a host read: picks past a crowded owner's chunk count too
    counters.sent_numel += picks
    yield
    wait(first_round)

    # stage 2: this rank, as an owner, sums its region (in rank order) and keeps the largest sums
    local, values, _ = first.unpack_counted_rows(incoming)
    chosen_local, chosen_sums = _owner_choice(local, values, largest, second.capacity)
    mine = chosen_local < largest
    message = scratch(f"split.message.{label}", second.size, torch.uint8, device).view(1, second.size)
    message, chosen = second.pack_rows(
        chosen_local[None], quantize(chosen_sums, vdtype)[None], mine.sum()[None], message
    )
    chosen = chosen[0]
    rounding = None
    if ctx.error_feedback and (chosen.dtype != torch.float32 or bits is not None):
        # the sum's rounding stays in its owner's residual; the padding adds -0.0, which changes nothing
        diff = torch.where(mine, (chosen_sums - chosen.float()).nan_to_num(0.0, 0.0, 0.0), -0.0)
        rounding = (torch.where(mine, regions.to_space(chosen_local, rank), 0), diff, mine)
    gathered = scratch(f"split.received.{label}", world * second.size, torch.uint8, device).view(world, second.size)
    issued = futures(ctx.comm.all_gather(gathered.view(-1), message.view(-1), counters))

    @functools.cache
    def receive() -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every owner's choice, decoded once: positions in its region, coordinates, values, which are real."""
        loc, vals, counts = second.unpack_counted_rows(gathered)
        real = torch.arange(second.capacity, device=device) < counts.unsqueeze(1)
        coords = torch.where(real, regions.to_space(loc, torch.arange(world, device=device).unsqueeze(1)), 0)
        return loc, coords, vals, real

    def settle_residuals() -> None:
        if not (ctx.error_feedback or ctx.momentum_correction):
            return
        loc = receive()[0]
        hit = torch.searchsorted(loc, sending).clamp_(max=second.capacity - 1)
        accepted = (loc.gather(1, hit) == sending) & placed
        # per pick of the selection (the padding's False goes to a spare last slot)
        taken = torch.zeros(picks + 1, dtype=torch.bool, device=device)
        taken = taken.index_put_((table.view(-1),), accepted.view(-1))[:picks]
        if sel.flat is not None and sel.at is not None:
            keep_unsent(sel.flat, sel.at, sel.exact, sel.sent, bits is not None, taken)
        else:
            settle(ctx, call, space, sel, taken.nonzero().squeeze(1))
        if rounding is not None:
            coords, diff, real = rounding
            if sel.flat is not None:
                sel.flat.index_add_(0, space.to_bucket(coords), diff)
                return
            coords, diff = coords[real], diff[real]
            for i, part, idx in space.by_member(coords):
                if sel.residual[i] is not None:  # None: a non-finite input, whose residual stays as it was
                    # looked up again: the small tensors' coded send may have made the residuals flat since
                    e = ctx.memory.get(call.plan.sparse_members[space.members[i]].name)
                    if e is not None:
                        e.index_add_(0, idx, diff[part])

    def apply(out: Tensor, scale: float | str = 1.0) -> None:
        _, coords, vals, real = receive()
        # the owners' sums carry no count of the parties in them: the count rule takes max(1, N/2) here
        alpha = (max(1.0, world / 2) if scale == BY_COUNT else float(scale)) / world
        # owners' coordinates are disjoint; the padding adds a zero that changes nothing (-0.0, or 0.0 if alpha < 0)
        vals = torch.where(real, vals.to(out.dtype), -0.0 if alpha >= 0 else 0.0)
        out.index_add_(0, space.to_bucket(coords.view(-1)), vals.view(-1), alpha=alpha)

    return Pending(issued, apply, settle=settle_residuals, chosen=True)
