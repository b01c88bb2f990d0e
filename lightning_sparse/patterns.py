"""Wire patterns: how the coordinates a compressor chose cross the wire, and what that costs.

A compressor names its pattern (``Compressor.pattern``); :data:`PATTERNS` maps the name to a
:class:`WirePattern`, which compresses a bucket's sparse members (error feedback included), packs
them into one message, launches the collective(s) and returns a :class:`Pending` that adds the
averaged values into the bucket (gradient hook) or the global parameters (update exchange):

- :class:`GatherPattern` - each rank's own ``k`` (value, index) pairs, all-gathered;
- :class:`SharedPattern` - every rank picks the same coordinates (shared seed), values all-reduced;
- :class:`SketchPattern` - count-sketch tables all-reduced, then exact values at the candidates.

The ring byte models (:func:`ring_all_reduce_bytes`, :func:`ring_all_gather_bytes`) are the one
place the package turns message sizes into traffic: they give each pattern's modelled wire size
(:meth:`WirePattern.wire_bytes`), which the hook's byte fallback and the adaptive density schedule
compare, and every collective actually issued is counted through :func:`count_all_reduce` /
:func:`count_all_gather`, which add the bytes handed to it (``Counters.sent_bytes``) and the bytes
the ring model says it moves through this rank (``Counters.wire_bytes``).

Layering: the hook (:mod:`lightning_sparse.hook`) decides per bucket between dense and sparse and
orchestrates the exchange; this module sits below it and below the density schedules, and imports
only the compressors, the collectives, the counters and the small helpers. It reads the hook's
:class:`~lightning_sparse.state.SparseState` through its attributes (the name is imported for
type checkers only).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.futures import Future

from lightning_sparse import comm
from lightning_sparse._utils import all_finite, scratch
from lightning_sparse.compressors import CompressContext
from lightning_sparse.indexcode import decode_indices, encode_indices, index_bytes, rice_capacity_bytes
from lightning_sparse.stats import Counters

if TYPE_CHECKING:
    from lightning_sparse.state import BucketPlan, Member, SparseState


_INDEX_BYTES = 4  # uncoded indices travel as int32; buckets are far below 2**31 elements

#: how a gather-pattern bucket crosses the wire (``SparseState(exchange=...)``)
EXCHANGES = ("auto", "allgather", "split")
#: the split exchange's ownership: blocks of this many coordinates go to the ranks in turn (odd,
#: so that a row length that is a power of two does not keep one column on one owner)
SPLIT_BLOCK = 127
#: each rank may send an owner up to this many times its fair share (k / W) of coordinates
SPLIT_SLACK = 2.0
#: ``exchange="auto"`` takes the split where it moves at most this fraction of the all-gather's wire
#: bytes (from about 16 ranks). The split applies about k coordinates where the all-gather applies
#: the union of every rank's k, and that costs accuracy: on a GPT with AdamW at 4 ranks the split
#: (0.78x the bytes) landed 0.07 nats further from dense; on a GRU with SGD at 8 ranks the split at
#: density 0.01 (0.50x the bytes) was 1.3 points below the all-gather, and the all-gather at half
#: the density (1.2x the split's bytes) still 1.0 point above it.
SPLIT_AUTO_RATIO = 0.25


# --------------------------------------------------------------------------- byte models
def ring_all_reduce_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-reduce of ``nbytes``."""
    return 2.0 * (world - 1) / world * nbytes


def ring_all_gather_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-gather of ``nbytes`` per rank."""
    return float((world - 1) * nbytes)


def count_all_reduce(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-reduce of ``nbytes`` this rank issued: the bytes handed to it, and its ring traffic."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += ring_all_reduce_bytes(world, nbytes)


def count_all_gather(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-gather of ``nbytes`` per rank this rank issued: the bytes handed to it, and its
    ring traffic."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += ring_all_gather_bytes(world, nbytes)


def count_all_to_all(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-to-all of ``nbytes`` (all W chunks) this rank issued: every chunk but its own
    leaves the rank, ``(W-1)/W * nbytes``."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += (world - 1) / world * nbytes if world > 1 else 0.0


def count_dense(counters: Counters, world: int, nbytes: int) -> None:
    """Record ``nbytes`` of gradient that plain DDP would all-reduce, and what that would move."""
    counters.dense_bytes += nbytes
    counters.dense_wire_bytes += ring_all_reduce_bytes(world, nbytes)


def _align(nbytes: int, to: int) -> int:
    return (nbytes + to - 1) // to * to


# --------------------------------------------------------------------------- compression
def _value_dtype(state: SparseState, buffer: Tensor) -> torch.dtype:
    return state.value_dtype or buffer.dtype


def gradient_of(state: SparseState, buffer: Tensor, m: Member) -> Tensor:
    """What the hook compresses for member ``m``: its gradient, or its local momentum (float32)."""
    source = state.sources.get(m.name)
    return source if source is not None else buffer[m.offset : m.offset + m.numel]


def _flush_residuals(state: SparseState, buffer: Tensor, members: tuple[Member, ...], counters: Counters) -> None:
    """Add any residual into the bucket before a dense send, so nothing stays behind unsent."""
    if not state.error_feedback:
        return
    for m in members:
        if m.name in state.memory:
            segment = buffer[m.offset : m.offset + m.numel]
            if not state.inputs_finite and not all_finite(segment):
                # Send the non-finite gradient as it is (every rank then sees a non-finite average
                # and the optimizer / gradient scaler skips the step); keep the residual unpoisoned.
                counters.nonfinite_buckets = 1
                continue
            state.memory.accumulate(m.name, segment)
            sent = state.memory.flush(m.name, buffer.dtype)
            assert sent is not None
            segment.copy_(sent)


# --------------------------------------------------------------------------- patterns
@dataclass
class Pending:
    """A launched part of a bucket's exchange: its futures, and how to write its result back.

    ``apply(out)`` runs once every future of the bucket has completed, on a zeroed buffer (the
    gradient hook) or the global parameters (the update exchange); each part adds the averaged
    values of its own coordinates into ``out``.
    """

    futures: list[Future[Any]]
    apply: Callable[[Tensor], None]


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
    ) -> float:
        """Bytes through each rank for the sparse members of a bucket (ring model); ``exchange``
        and ``compact`` (index coding) matter to the gather pattern only."""
        raise NotImplementedError

    def launch(
        self, state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters
    ) -> Pending:
        """Compress the bucket's sparse members, update their residuals, launch the collectives."""
        raise NotImplementedError


def _quantize(values: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast values for the wire; float16 saturates at its largest finite value instead of
    overflowing to inf, so the part above it stays in the residual rather than poisoning it."""
    if dtype == values.dtype:
        return values
    if dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        values = values.clamp(-limit, limit)
    return values.to(dtype)


# --------------------------------------------------------------------------- gather messages
@dataclass(frozen=True)
class SparseSpace:
    """A bucket's sparse members laid end to end: the coordinates gather messages address.

    Addressing this space rather than the bucket keeps the tensors sent dense (biases, norms)
    out of the index range, which the compact index code's size depends on. The members are laid
    out by name, not in the bucket's order: DDP orders a bucket differently before and after it
    rebuilds its buckets (the first step of a run, resumed runs included), and the split
    exchange's ownership of coordinates must not depend on that.
    """

    numel: int
    members: tuple[int, ...]  # the sparse members (positions in ``plan.sparse_members``) in space order
    starts: tuple[int, ...]  # each one's first coordinate in this space (ascending)
    offsets: tuple[int, ...]  # and in the bucket

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def of(plan: BucketPlan) -> SparseSpace:
        sparse = plan.sparse_members
        order = sorted(range(len(sparse)), key=lambda i: sparse[i].name)
        starts, offsets, pos = [], [], 0
        for i in order:
            starts.append(pos)
            offsets.append(sparse[i].offset)
            pos += sparse[i].numel
        return SparseSpace(pos, tuple(order), tuple(starts), tuple(offsets))

    def to_bucket(self, coords: Tensor) -> Tensor:
        """Bucket offsets of sparse-space coordinates (int64)."""
        shifts = [o - s for o, s in zip(self.offsets, self.starts, strict=True)]
        if all(x == shifts[0] for x in shifts):
            return coords + shifts[0] if shifts[0] else coords
        starts = torch.tensor(self.starts, dtype=torch.int64, device=coords.device)
        member = torch.searchsorted(starts, coords, right=True) - 1
        return coords + torch.tensor(shifts, dtype=torch.int64, device=coords.device)[member]

    def by_member(self, coords: Tensor) -> list[tuple[int, slice, Tensor]]:
        """Split ascending coordinates by member: ``(position in space order, slice of coords, member-local
        indices)`` for each member that has any."""
        bounds = torch.tensor((*self.starts, self.numel), dtype=torch.int64, device=coords.device)
        cuts = torch.searchsorted(coords, bounds).tolist()
        return [
            (i, slice(cuts[i], cuts[i + 1]), coords[cuts[i] : cuts[i + 1]] - self.starts[i])
            for i in range(len(self.starts))
            if cuts[i + 1] > cuts[i]
        ]


@dataclass(frozen=True)
class MessageLayout:
    """A fixed-size message of up to ``capacity`` (value, coordinate) pairs in ``[0, n)``.

    ``[count: int32, 4 bytes of padding (with header)][values][to 4 bytes][indices][to 8 bytes]``:
    values first so that their views are aligned, indices as int32 or, with ``compact``, in the
    Rice code of :mod:`lightning_sparse.indexcode` wherever that is smaller. The size depends only
    on ``(n, capacity, value dtype, compact, header)``: the same on every rank, as the
    collectives need. Without a header the message always holds exactly ``capacity`` pairs.

    Example:
        >>> import torch
        >>> layout = MessageLayout(n=10_000, capacity=100, value_dtype=torch.bfloat16, compact=True)
        >>> layout.coding, layout.size
        ('rice', 312)
        >>> coords = torch.arange(0, 10_000, 100)
        >>> got, values = layout.unpack(layout.pack(coords, torch.ones(100)))
        >>> torch.equal(got, coords), values.dtype
        (True, torch.bfloat16)
    """

    n: int
    capacity: int
    value_dtype: torch.dtype
    compact: bool
    header: bool = False

    @functools.cached_property
    def coding(self) -> str:
        if self.compact and rice_capacity_bytes(self.n, self.capacity) < _INDEX_BYTES * self.capacity:
            return "rice"
        return "int32"

    @functools.cached_property
    def _values_at(self) -> int:
        return 8 if self.header else 0

    @functools.cached_property
    def _index_at(self) -> int:
        return _align(self._values_at + self.capacity * self.value_dtype.itemsize, 4)

    @functools.cached_property
    def _index_bytes(self) -> int:
        return index_bytes(self.n, self.capacity, self.coding)

    @functools.cached_property
    def size(self) -> int:
        """Bytes per message (8-byte aligned, so every rank's part of a gathered buffer is too)."""
        return _align(self._index_at + self._index_bytes, 8)

    def pack(self, coords: Tensor, values: Tensor, out: Tensor | None = None) -> Tensor:
        """Write sorted unique ``coords`` and their ``values`` (cast to ``value_dtype``) into a
        zeroed uint8 message (``out``: a view of :attr:`size` bytes, or a new tensor)."""
        count = coords.numel()
        if count > self.capacity or (not self.header and count != self.capacity):
            raise ValueError(f"{count} pairs do not fit a message of capacity {self.capacity}")
        if out is None:
            out = torch.zeros(self.size, dtype=torch.uint8, device=coords.device)
        else:
            out.zero_()
        vb = self.value_dtype.itemsize
        if self.header:
            out[:4].view(torch.int32).fill_(count)
        out[self._values_at : self._values_at + count * vb].view(self.value_dtype).copy_(values)
        index = out[self._index_at : self._index_at + self._index_bytes]
        if self.coding == "rice":
            encode_indices(coords, self.n, self.capacity, out=index)
        else:
            index[: count * _INDEX_BYTES].view(torch.int32).copy_(coords)
        return out

    def unpack(self, message: Tensor) -> tuple[Tensor, Tensor]:
        """``(int64 coordinates, values in value_dtype)`` of a message :meth:`pack` wrote."""
        count = int(message[:4].view(torch.int32)) if self.header else self.capacity
        vb = self.value_dtype.itemsize
        values = message[self._values_at : self._values_at + count * vb].view(self.value_dtype)
        index = message[self._index_at : self._index_at + self._index_bytes]
        if self.coding == "rice":
            coords = decode_indices(index, self.n, self.capacity, count)
        else:
            coords = index[: count * _INDEX_BYTES].view(torch.int32).long()
        return coords, values


@dataclass
class Selection:
    """A bucket's selected coordinates, sorted, before they cross the wire.

    ``coords``: sparse-space coordinates (int64, ascending); ``exact``: ``p`` there (before the
    value dtype's rounding); ``sent``: the values as they travel; ``residual``: per sparse member
    in :class:`SparseSpace` order, the residual buffer holding ``p = g + e`` (None: no error
    feedback, or a non-finite input).
    """

    coords: Tensor
    exact: Tensor
    sent: Tensor
    residual: list[Tensor | None]


def select_sorted(
    state: SparseState,
    buffer: Tensor,
    plan: BucketPlan,
    ks: list[int],
    vdtype: torch.dtype,
    counters: Counters,
    settle: bool,
) -> Selection:
    """Select ``ks`` coordinates of each sparse member (error feedback included), sorted.

    With ``settle`` the residuals keep what is not sent right away (``sent + e_new == p``: the
    all-gather and the shared patterns); without, they keep all of ``p`` and the caller settles
    what was finally sent (the split exchange). A member whose input is not finite sends NaN, at
    its first ``k`` coordinates or, for a shared pattern, at the coordinates every rank picks, and
    leaves its residual as it was; ``counters.nonfinite_buckets`` is then set.
    """
    compressor = state.compressor
    space = SparseSpace.of(plan)
    coords, exact, sent, residual = [], [], [], []
    for i, start in zip(space.members, space.starts, strict=True):
        m, k = plan.sparse_members[i], ks[i]
        g = gradient_of(state, buffer, m)
        ctx = CompressContext(step=state.step, key=m.key, rank=state.rank, world_size=state.world_size, seed=state.seed)
        if not state.inputs_finite and not all_finite(g):
            # the same message shape as always, NaN values: every rank sees a non-finite average
            # and skips the step alike; this rank's residual keeps its previous value
            counters.nonfinite_buckets = 1
            if state.schedule.observes:
                state.schedule.observe(state.step, plan.label, m.name, g)
            shared = compressor.pattern == "shared"
            idx = compressor.select(g, k, ctx).sort().values if shared else torch.arange(k, device=g.device)
            values = torch.full((k,), float("nan"), dtype=torch.float32, device=g.device)
            coords.append(idx + start)
            exact.append(values)
            sent.append(values.to(vdtype))
            residual.append(None)
            continue
        p = state.memory.accumulate(m.name, g) if state.error_feedback else g
        if state.schedule.observes:
            state.schedule.observe(state.step, plan.label, m.name, p)
        idx = compressor.select(p, k, ctx)
        if idx.numel() != k:
            raise RuntimeError(f"{type(compressor).__name__}.select returned {idx.numel()} indices for k={k}")
        idx = idx.sort().values
        values = p[idx]
        q = _quantize(values, vdtype)
        if settle:
            if state.error_feedback:
                state.memory.keep_unsent(m.name, idx, None if q.dtype == values.dtype else values - q.to(values.dtype))
            if state.momentum_correction:
                state.velocity.mask(m.name, idx)
        coords.append(idx + start if start else idx)
        exact.append(values)
        sent.append(q)
        residual.append(p if state.error_feedback else None)
    return Selection(torch.cat(coords), torch.cat(exact), torch.cat(sent), residual)


class GatherPattern(WirePattern):
    """Each rank selects its own ``k`` coordinates per tensor; two ways to combine them:

    - ``"allgather"``: every rank's (value, coordinate) pairs are all-gathered and summed, in rank
      order, by every rank. Traffic per rank grows with W: ``(W-1)`` messages.
    - ``"split"`` (Ok-Topk's sparse all-reduce, Li and Hoefler, PPoPP 2022): the coordinates are
      split among the ranks in blocks of :data:`SPLIT_BLOCK`, taken in turn; each rank sends each
      owner its pairs in the owner's region (one all-to-all, at most ``SPLIT_SLACK * k / W`` pairs
      per owner: the largest, when more fall there), every owner sums what it got, keeps the
      ``k / W`` largest sums and the owners' choices are all-gathered: the bucket's global
      selection, about ``k`` coordinates. Traffic per rank about ``3k (W-1)/W`` pairs, flat in W.
      What a rank selected and that did not reach the global selection (not chosen by its owner,
      or past its share) stays in its residual; the rounding of a sum to the value dtype stays in
      its owner's residual, so nothing is lost: sum over ranks of (sent + residual) is conserved.

    ``"auto"`` takes the split where it moves at most :data:`SPLIT_AUTO_RATIO` of the all-gather's
    bytes through each rank under the ring model (from about 16 ranks), else the all-gather: the
    same choice on every rank (it depends only on sizes). Messages hold sparse-space coordinates
    (:class:`SparseSpace`), coded by :class:`MessageLayout`.
    """

    def choose(
        self, world: int, ks: list[int], vbytes: int, numels: list[int], exchange: str, compact: bool
    ) -> tuple[str, float]:
        """``(exchange, wire bytes per rank)`` for a bucket's sparse members.

        Asked up to three times per bucket and step (the byte fallback, the telemetry's label, the
        launch) and for every candidate of an adaptive density: the answer depends on sizes only
        and is kept."""
        return _choose(world, sum(ks), vbytes, sum(numels), exchange, compact)

    def wire_bytes(
        self,
        world: int,
        ks: list[int],
        vbytes: int,
        numels: list[int],
        compressor: Any = None,
        exchange: str = "allgather",
        compact: bool = False,
    ) -> float:
        return self.choose(world, ks, vbytes, numels, exchange, compact)[1]

    def launch(
        self, state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters
    ) -> Pending:
        vdtype = _value_dtype(state, buffer)
        numels = [m.numel for m in plan.sparse_members]
        how, _ = self.choose(state.world_size, ks, vdtype.itemsize, numels, state.exchange, state.compact_indices)
        if how == "split":
            return _launch_split(state, buffer, plan, ks, counters, vdtype)
        return _launch_allgather(state, buffer, plan, ks, counters, vdtype)


_DTYPE_OF_SIZE = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@functools.lru_cache(maxsize=4096)
def _choose(world: int, k: int, vbytes: int, n: int, exchange: str, compact: bool) -> tuple[str, float]:
    vdtype = _DTYPE_OF_SIZE[vbytes]
    gather = ring_all_gather_bytes(world, MessageLayout(n, k, vdtype, compact).size)
    if exchange == "allgather" or world <= 1:
        return "allgather", gather
    split = split_wire_bytes(world, n, k, vdtype, compact)
    if exchange == "split" or split <= SPLIT_AUTO_RATIO * gather:
        return "split", split
    return "allgather", gather


def _launch_allgather(
    state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters, vdtype: torch.dtype
) -> Pending:
    world = state.world_size
    space = SparseSpace.of(plan)
    layout = MessageLayout(space.numel, sum(ks), vdtype, state.compact_indices)
    sel = select_sorted(state, buffer, plan, ks, vdtype, counters, settle=True)
    message = layout.pack(sel.coords, sel.sent)
    counters.sent_numel += sel.coords.numel()
    count_all_gather(counters, world, message.numel())
    if world > 1:
        gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=buffer.device)
        futures = [comm.all_gather(gathered, message, state.process_group)]
    else:
        gathered, futures = message, []

    def apply(out: Tensor) -> None:
        size = layout.size
        for r in range(world):
            coords, values = layout.unpack(gathered[r * size : (r + 1) * size])
            # Each rank's coordinates are unique, so every add lands on its own coordinate and the
            # sum over ranks happens in rank order: identical bits on every rank, CUDA included.
            out.index_add_(0, space.to_bucket(coords), values.to(out.dtype), alpha=1.0 / world)

    return Pending(futures, apply)


# --------------------------------------------------------------------------- split exchange
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
    n: int, k: int, world: int, vdtype: torch.dtype, compact: bool
) -> tuple[MessageLayout, MessageLayout]:
    send, keep = split_capacities(n, k, world)
    largest = Regions(n, world).largest
    return (
        MessageLayout(largest, send, vdtype, compact, header=True),
        MessageLayout(largest, keep, vdtype, compact, header=True),
    )


def split_wire_bytes(world: int, n: int, k: int, vdtype: torch.dtype, compact: bool) -> float:
    """Bytes through each rank for the split exchange of ``k`` coordinates per rank out of ``n``."""
    if world <= 1:
        return 0.0
    first, second = split_layouts(n, k, world, vdtype, compact)
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


def _launch_split(
    state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters, vdtype: torch.dtype
) -> Pending:
    world, rank, group = state.world_size, state.rank, state.process_group
    space = SparseSpace.of(plan)
    regions = Regions(space.numel, world)
    first, second = split_layouts(space.numel, sum(ks), world, vdtype, state.compact_indices)
    sel = select_sorted(state, buffer, plan, ks, vdtype, counters, settle=False)
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
    counters.sent_numel += placed.numel()
    count_all_to_all(counters, world, outgoing.numel())
    incoming = torch.empty_like(outgoing)
    # waited for on this thread, and stage 2 issued right after: every collective of every bucket
    # is issued by one thread in the same order on every rank (see SketchPattern)
    comm.all_to_all(incoming, outgoing, group).wait()

    # stage 2: this rank, as an owner, sums its region (in rank order) and keeps the largest sums
    parts = [first.unpack(incoming[r]) for r in range(world)]
    local = torch.cat([c for c, _ in parts])
    values = torch.cat([v for _, v in parts]).float()
    unique, where = torch.unique(local, sorted=True, return_inverse=True)
    sums = torch.zeros(unique.numel(), dtype=torch.float32, device=buffer.device).index_add_(0, where, values)
    keep = min(second.capacity, unique.numel())
    top = torch.topk(sums.abs().nan_to_num(nan=math.inf), keep, sorted=False).indices.sort().values
    chosen_sums = sums[top]
    chosen = _quantize(chosen_sums, vdtype)
    message = second.pack(unique[top], chosen)
    rounding = None
    if state.error_feedback and chosen.dtype != torch.float32:
        # the sum's rounding to the value dtype stays with its owner, in its residual
        rounding = (regions.to_space(unique[top], rank), (chosen_sums - chosen.float()).nan_to_num(0.0, 0.0, 0.0))
    count_all_gather(counters, world, message.numel())
    gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=buffer.device)
    futures = [comm.all_gather(gathered, message, group)]

    def apply(out: Tensor) -> None:
        size = second.size
        selected = []
        for j in range(world):
            loc, vals = second.unpack(gathered[j * size : (j + 1) * size])
            coords = regions.to_space(loc, j)
            out.index_add_(0, space.to_bucket(coords), vals.to(out.dtype), alpha=1.0 / world)
            selected.append(coords)
        if not (state.error_feedback or state.momentum_correction):
            return
        # settle this rank's residuals: what reached the global selection was sent, the rest stays
        sent_pos = placed.sort().values
        accepted = sent_pos[torch.isin(sel.coords[sent_pos], torch.cat(selected))]
        _settle(state, plan, space, sel, accepted, vdtype)
        if rounding is not None:
            coords, diff = rounding
            for i, part, idx in space.by_member(coords):
                e = sel.residual[i]
                if e is not None:
                    e.index_add_(0, idx, diff[part])

    return Pending(futures, apply)


def _settle(
    state: SparseState, plan: BucketPlan, space: SparseSpace, sel: Selection, accepted: Tensor, vdtype: torch.dtype
) -> None:
    """Take the coordinates at positions ``accepted`` of the selection out of the residuals."""
    coords = sel.coords[accepted]
    for i, part, idx in space.by_member(coords):
        if sel.residual[i] is None and state.error_feedback:
            continue  # non-finite input: the residual keeps its previous value
        m = plan.sparse_members[space.members[i]]
        if state.error_feedback:
            exact, sent = sel.exact[accepted[part]], sel.sent[accepted[part]]
            state.memory.keep_unsent(m.name, idx, None if sent.dtype == exact.dtype else exact - sent.to(exact.dtype))
        if state.momentum_correction:
            state.velocity.mask(m.name, idx)


class SharedPattern(WirePattern):
    """Every rank picks the same coordinates (shared seed): only values are all-reduced."""

    def wire_bytes(
        self,
        world: int,
        ks: list[int],
        vbytes: int,
        numels: list[int],
        compressor: Any = None,
        exchange: str = "allgather",
        compact: bool = False,
    ) -> float:
        return ring_all_reduce_bytes(world, sum(ks) * vbytes)

    def launch(
        self, state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters
    ) -> Pending:
        world = state.world_size
        space = SparseSpace.of(plan)
        # every rank picks the same coordinates, so the values line up in every rank's message
        sel = select_sorted(state, buffer, plan, ks, _value_dtype(state, buffer), counters, settle=True)
        message = sel.sent
        counters.sent_numel += message.numel()
        count_all_reduce(counters, world, message.numel() * message.element_size())
        futures = [comm.all_reduce(message, state.process_group)] if world > 1 else []

        def apply(out: Tensor) -> None:
            out.index_add_(0, space.to_bucket(sel.coords), message.to(out.dtype), alpha=1.0 / world)

        return Pending(futures, apply)


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
    after it, before the hook returns. Every collective of every bucket is therefore issued by
    the same thread in the same order on every rank; issuing round 2 from a completion callback
    (a process-group thread) could interleave it differently with other buckets' collectives on
    each rank. The cost is that backward waits for one small all-reduce per bucket.
    """

    def wire_bytes(
        self,
        world: int,
        ks: list[int],
        vbytes: int,
        numels: list[int],
        compressor: Any = None,
        exchange: str = "allgather",
        compact: bool = False,
    ) -> float:
        if compressor is None:
            raise ValueError("the sketch pattern's wire size depends on the compressor's settings: pass compressor")
        shapes = [compressor.table_shape(n, k) for n, k in zip(numels, ks, strict=True)]
        table_bytes = sum(r * c for r, c in shapes) * 4
        value_bytes = sum(compressor.num_candidates(n, k) for n, k in zip(numels, ks, strict=True)) * vbytes
        return ring_all_reduce_bytes(world, table_bytes) + ring_all_reduce_bytes(world, value_bytes)

    def launch(
        self, state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters
    ) -> Pending:
        compressor = state.compressor
        world = state.world_size
        vdtype = _value_dtype(state, buffer)
        members = plan.sparse_members
        shapes = [compressor.table_shape(m.numel, k) for m, k in zip(members, ks, strict=True)]
        # The tables live only until round 1 completes, inside this call: a reused buffer saves
        # the page faults of a fresh multi-MB allocation every step.
        tables = scratch("patterns.sketch_tables", sum(r * c for r, c in shapes), torch.float32, buffer.device).zero_()
        ps: list[Tensor | None] = []
        ctxs: list[CompressContext] = []
        views: list[Tensor] = []
        pos = 0
        for m, k, (rows, cols) in zip(members, ks, shapes, strict=True):
            g = gradient_of(state, buffer, m)
            ctx = CompressContext(step=state.step, key=m.key, rank=state.rank, world_size=world, seed=state.seed)
            view = tables[pos : pos + rows * cols].view(rows, cols)
            p: Tensor | None = None
            if state.inputs_finite or all_finite(g):
                p = state.memory.accumulate(m.name, g) if state.error_feedback else g
                compressor.sketch(p, k, ctx, view)
            else:
                # Sketch nothing (the summed tables stay finite, so every rank still finds the same
                # candidates), then send NaN in round 2: every rank gets a non-finite average and
                # skips the step alike; this rank's residual keeps its previous value.
                counters.nonfinite_buckets = 1
            if state.schedule.observes:  # as in select_sorted: every rank observes every member
                state.schedule.observe(state.step, plan.label, m.name, p if p is not None else g)
            ps.append(p)
            ctxs.append(ctx)
            views.append(view)
            pos += rows * cols
        if world > 1:
            comm.all_reduce(tables, state.process_group).wait()  # round 1, on this thread (see above)
        cands = [
            compressor.candidates(view, m.numel, k, ctx)
            for view, m, k, ctx in zip(views, members, ks, ctxs, strict=True)
        ]
        values = torch.empty(sum(c.numel() for c in cands), dtype=vdtype, device=buffer.device)
        pos = 0
        for p, cand in zip(ps, cands, strict=True):
            if p is None:
                values[pos : pos + cand.numel()].fill_(float("nan"))
            else:
                values[pos : pos + cand.numel()].copy_(_quantize(p[cand], vdtype))
            pos += cand.numel()
        counters.sent_numel += sum(ks)
        count_all_reduce(counters, world, tables.numel() * tables.element_size())
        count_all_reduce(counters, world, values.numel() * values.element_size())
        futures = [comm.all_reduce(values, state.process_group)] if world > 1 else []

        def apply(out: Tensor) -> None:
            start = 0
            for m, k, p, cand in zip(members, ks, ps, cands, strict=True):
                sums = values[start : start + cand.numel()]
                start += cand.numel()
                chosen = compressor.pick(sums, k)
                idx = cand[chosen]
                if state.error_feedback and p is not None:  # p: the residual buffer, untouched since launch
                    exact = p[idx]
                    sent = _quantize(exact, vdtype)
                    remainder = None if sent.dtype == exact.dtype else exact - sent.to(exact.dtype)
                    state.memory.keep_unsent(m.name, idx, remainder)
                if state.momentum_correction and p is not None:
                    state.velocity.mask(m.name, idx)
                out.index_add_(0, idx + m.offset, sums[chosen].to(out.dtype), alpha=1.0 / world)

        return Pending(futures, apply)


#: communication pattern name (``Compressor.pattern``) -> how it crosses the wire
PATTERNS: dict[str, WirePattern] = {"gather": GatherPattern(), "shared": SharedPattern(), "sketch": SketchPattern()}


def _launch_dense_members(state: SparseState, buffer: Tensor, plan: BucketPlan, counters: Counters) -> Pending:
    """All-reduce the bucket's small tensors (below ``min_numel``) as one packed message."""
    dense = plan.dense_members
    if not dense:
        return Pending([], lambda out: None)
    _flush_residuals(state, buffer, dense, counters)
    values = torch.cat([buffer[m.offset : m.offset + m.numel] for m in dense])
    world = state.world_size
    count_all_reduce(counters, world, values.numel() * values.element_size())
    counters.sent_numel += values.numel()
    futures = [comm.all_reduce(values, state.process_group)] if world > 1 else []

    def apply(out: Tensor) -> None:
        values.div_(world)
        pos = 0
        for m in dense:
            out[m.offset : m.offset + m.numel].add_(values[pos : pos + m.numel])
            pos += m.numel

    return Pending(futures, apply)
