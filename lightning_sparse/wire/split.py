"""The split exchange, after Ok-Topk's sparse all-reduce (Li and Hoefler, PPoPP 2022).

Owners of block-cyclic regions of a bucket's sparse space sum what the ranks selected there, keep
the largest sums, and the owners' choices are all-gathered. Traffic per rank about flat in the
number of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.wire.comm import Rounds, futures, wait
from lightning_sparse.wire.context import BucketCall, Pending, WireContext
from lightning_sparse.wire.cost import ring_all_gather_bytes
from lightning_sparse.wire.message import MessageLayout, SparseSpace, quantize
from lightning_sparse.wire.select import select_sorted, settle

#: the split exchange's ownership: blocks of this many coordinates go to the ranks in turn (odd,
#: so that a row length that is a power of two does not keep one column on one owner)
SPLIT_BLOCK = 127
#: each rank may send an owner up to this many times its fair share (k / W) of coordinates
SPLIT_SLACK = 2.0


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
        cycle = self.block * self.world
        full, rest = divmod(self.n, cycle)
        return tuple(full * self.block + min(max(rest - j * self.block, 0), self.block) for j in range(self.world))

    @property
    def largest(self) -> int:
        return self.sizes[0]

    def owner(self, coords: Tensor) -> Tensor:
        return torch.div(coords, self.block, rounding_mode="floor") % self.world

    def local(self, coords: Tensor) -> Tensor:
        """Position within the owner's region (increasing with the coordinate)."""
        return torch.div(coords, self.block * self.world, rounding_mode="floor") * self.block + coords % self.block

    def to_space(self, local: Tensor, owner: int) -> Tensor:
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
) -> tuple[MessageLayout, MessageLayout]:
    send, keep = split_capacities(n, k, world)
    largest = Regions(n, world).largest
    return (
        MessageLayout(largest, send, vdtype, compact, header=True, value_bits=value_bits),
        MessageLayout(largest, keep, vdtype, compact, header=True, value_bits=value_bits),
    )


def split_wire_bytes(
    world: int, n: int, k: int, vdtype: torch.dtype, compact: bool, value_bits: int | None = None
) -> float:
    """Bytes through each rank for the split exchange of ``k`` coordinates per rank out of ``n``."""
    if world <= 1:
        return 0.0
    first, second = split_layouts(n, k, world, vdtype, compact, value_bits)
    return (world - 1) * first.size + ring_all_gather_bytes(world, second.size)


def _keep_largest_per_owner(owner: Tensor, magnitude: Tensor, world: int, cap: int) -> Tensor:
    """Positions of the selection grouped by owner (ascending within), at most ``cap`` per owner:
    the largest magnitudes where more fall on one owner."""
    counts = torch.bincount(owner, minlength=world)
    if int(counts.max()) <= cap:
        return torch.argsort(owner, stable=True)
    by_size = torch.argsort(magnitude, descending=True, stable=True)
    grouped = by_size[torch.argsort(owner[by_size], stable=True)]
    first = torch.cumsum(counts, 0) - counts
    rank_in_owner = torch.arange(grouped.numel(), device=owner.device) - first[owner[grouped]]
    kept = grouped[rank_in_owner < cap].sort().values
    return kept[torch.argsort(owner[kept], stable=True)]


def launch_split(ctx: WireContext, call: BucketCall, ks: list[int], vdtype: torch.dtype) -> Rounds[Pending]:
    """Launch the split exchange of a gather-pattern bucket (see :class:`GatherPattern`), in rounds:
    it yields once its all-to-all is issued, and waits for it when resumed."""
    world, rank, buffer, counters = ctx.world_size, ctx.rank, call.buffer, call.counters
    space = SparseSpace.of(call.plan)
    regions = Regions(space.numel, world)
    bits = ctx.value_bits
    first, second = split_layouts(space.numel, sum(ks), world, vdtype, ctx.compact_indices, bits)
    sel = select_sorted(ctx, call, ks, vdtype, settle=False)
    owner = regions.owner(sel.coords)
    magnitude = sel.exact.abs().nan_to_num(nan=math.inf)
    placed = _keep_largest_per_owner(owner, magnitude, world, first.capacity)
    per_owner = torch.bincount(owner[placed], minlength=world).tolist()

    # stage 1: each owner gets this rank's pairs in its region (fixed-size chunks, one all-to-all)
    outgoing = torch.empty(world, first.size, dtype=torch.uint8, device=buffer.device)
    pos = 0
    for j, count in enumerate(per_owner):
        mine = placed[pos : pos + count]
        pos += count
        first.pack(regions.local(sel.coords[mine]), sel.sent[mine], outgoing[j])
        if bits is not None:  # what the owner receives is what the codes stand for
            sel.sent[mine] = first.unpack(outgoing[j])[1]
    counters.sent_numel += placed.numel()
    incoming = torch.empty_like(outgoing)
    # waited for on this thread, and stage 2 issued right after: every collective of every bucket
    # is issued by one thread in the same order on every rank (see SketchPattern); the other
    # buckets' first rounds are issued meanwhile (yield)
    first_round = ctx.comm.all_to_all(incoming, outgoing, counters)
    yield
    wait(first_round)

    # stage 2: this rank, as an owner, sums its region (in rank order) and keeps the largest sums
    parts = [first.unpack(incoming[r]) for r in range(world)]
    local = torch.cat([c for c, _ in parts])
    values = torch.cat([v for _, v in parts]).float()
    unique, where = torch.unique(local, sorted=True, return_inverse=True)
    sums = torch.zeros(unique.numel(), dtype=torch.float32, device=buffer.device).index_add_(0, where, values)
    keep = min(second.capacity, unique.numel())
    top = torch.topk(sums.abs().nan_to_num(nan=math.inf), keep, sorted=False).indices.sort().values
    chosen_sums = sums[top]
    chosen = quantize(chosen_sums, vdtype)
    message = second.pack(unique[top], chosen)
    if bits is not None:
        chosen = second.unpack(message)[1]
    rounding = None
    if ctx.error_feedback and (chosen.dtype != torch.float32 or bits is not None):
        # the sum's rounding to the value dtype stays with its owner, in its residual
        rounding = (regions.to_space(unique[top], rank), (chosen_sums - chosen.float()).nan_to_num(0.0, 0.0, 0.0))
    gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=buffer.device)
    issued = futures(ctx.comm.all_gather(gathered, message, counters))

    size = second.size
    received: list[tuple[Tensor, Tensor]] = []  # per rank: its chosen coordinates (in the space), values

    def receive() -> list[tuple[Tensor, Tensor]]:
        if not received:  # decoded once, for the residuals and for the average
            for j in range(world):
                loc, vals = second.unpack(gathered[j * size : (j + 1) * size])
                received.append((regions.to_space(loc, j), vals))
        return received

    def settle_residuals() -> None:
        # this rank's residuals: what reached the global selection was sent, the rest stays
        if not (ctx.error_feedback or ctx.momentum_correction):
            return
        sent_pos = placed.sort().values
        accepted = sent_pos[torch.isin(sel.coords[sent_pos], torch.cat([c for c, _ in receive()]))]
        settle(ctx, call, space, sel, accepted)
        if rounding is not None:
            coords, diff = rounding
            if sel.flat is not None:  # selected at once: the bucket's residuals are one tensor
                sel.flat.index_add_(0, space.to_bucket(coords), diff)
                return
            for i, part, idx in space.by_member(coords):
                if sel.residual[i] is not None:  # None: a non-finite input, whose residual stays as it was
                    # the residual as it is now: the small tensors' coded send may have moved the
                    # bucket's residuals into one flat tensor since the selection
                    e = ctx.memory.get(call.plan.sparse_members[space.members[i]].name)
                    if e is not None:
                        e.index_add_(0, idx, diff[part])

    def apply(out: Tensor, scale: float = 1.0) -> None:
        for coords, vals in receive():
            out.index_add_(0, space.to_bucket(coords), vals.to(out.dtype), alpha=scale / world)

    return Pending(issued, apply, settle=settle_residuals, chosen=True)
