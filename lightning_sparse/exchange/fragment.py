"""Update mode's fragments (torchft's streaming fragments): a :class:`Fragment` owns its parameters' buckets."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.futures import Future

from lightning_sparse._utils import RegionViews
from lightning_sparse.exchange.state import SparseState
from lightning_sparse.wire import Average, BucketPlan, WireContext, count_dense
from lightning_sparse.wire.batched import residual_layout
from lightning_sparse.wire.memory import ErrorFeedback
from lightning_sparse.wire.stats import Counters

__all__ = [
    "Bucket", "Commit", "Fragment", "InFlight", "bucket_parts", "check_fragments", "count_local",
    "decay_residuals", "drop_nonfinite", "fragments_of", "progress", "split_fragments",
]  # fmt: skip


class Bucket:
    """Parameters exchanged in one message: a float32 update buffer and their global values, flat."""

    def __init__(
        self, names: list[str], params: list[Tensor], globals_: dict[str, Tensor], home: torch.device, pin: bool
    ) -> None:
        self.names = names
        self.params = params
        numel = sum(p.numel() for p in params)
        first = params[0]
        self.delta = torch.empty(numel, dtype=torch.float32, device=first.device)
        self.glob = torch.empty(numel, dtype=first.dtype, device=home, pin_memory=pin)
        self._pending: Tensor | None = None
        self._flat_params: list[Tensor] | None = None
        self._cast: Tensor | None = None
        self._regions: tuple[tuple[int, int], ...] = ()
        self.views: list[Tensor] = []  # of the global values, shaped
        self.delta_views: list[Tensor] = []
        pos = 0
        for name, p in zip(names, params, strict=True):
            view = self.glob[pos : pos + p.numel()].view(p.shape)
            old = globals_.get(name)
            if old is not None:
                view.copy_(old)
            globals_[name] = view
            self.views.append(view)
            self.delta_views.append(self.delta[pos : pos + p.numel()])
            self._regions += ((pos, p.numel()),)
            pos += p.numel()
        self._change_views = RegionViews(self._regions, tuple(p.shape for p in params))

    def flat_params(self) -> list[Tensor] | None:
        """The parameters as flat views (kept while their memory stays), None where one is not contiguous."""
        views = self._flat_params
        if views is not None:
            for v, p in zip(views, self.params, strict=True):
                if v.data_ptr() != p.data_ptr():
                    break
            else:
                return views
        if not all([p.is_contiguous() for p in self.params]):
            return None
        views = self._flat_params = [p.view(-1) for p in self.params]
        return views

    def put_residuals(self, source: Tensor, memory: ErrorFeedback) -> None:
        """``e = source`` (laid out like :attr:`delta`) for each tensor that has a residual."""
        for (pos, numel), name in zip(self._regions, self.names, strict=True):
            e = memory.get(name)
            if e is not None:
                e.view(-1).copy_(source[pos : pos + numel])

    def add_change(self, change: Tensor) -> None:
        """Add ``change`` (float32, laid out like :attr:`delta`) to the parameters, in their dtype."""
        if self.params[0].device != change.device:
            for (pos, numel), p in zip(self._regions, self.params, strict=True):
                p.add_(change[pos : pos + numel].view_as(p).to(p.dtype))
            return
        if change.dtype != self.glob.dtype:
            if self._cast is None:
                self._cast = torch.empty(change.numel(), dtype=self.glob.dtype, device=change.device)
            change = self._cast.copy_(change)
        torch._foreach_add_(self.params, self._change_views.of(change))

    def pending_buffer(self) -> Tensor:
        """A buffer like :attr:`delta` for what this rank hands over while an exchange is in flight."""
        if self._pending is None:
            self._pending = torch.empty_like(self.delta)
        return self._pending

    def land(self, average: Average, state: SparseState, apply: Callable[..., None]) -> None:
        """Its exchange in flight arrives (``apply(bucket, average)``: the outer step); the view keeps its
        unaveraged part: ``p += new - (old + sent)``."""
        average.settle()  # the residuals hold what this rank did not send (split: only now)
        target = self.pending_buffer()  # in place: u - e_new (what this rank sent), then + global_old
        memory = state.memory
        flat = _flat_residual(memory, state.wire, state.plan(self.delta, self.params), self.delta)
        if flat is not None:
            target.sub_(flat)
        else:
            for (pos, numel), name in zip(self._regions, self.names, strict=True):
                e = memory.get(name) if name in memory else None
                if e is not None:
                    target[pos : pos + numel].sub_(e.to(target.device))
        target.add_(self.glob.to(target.device))
        apply(self, average)
        change = torch.sub(self.glob.to(target.device), target, out=target)  # 0 where nothing moved: bits kept
        self.add_change(change)
        memory.unstage(self.names)  # offloaded residuals go back to the CPU

    def hand_over(self, parts: list[tuple[str, Tensor, Tensor | None, int]], flat: Tensor | None) -> None:
        """``u = e + delta`` into :meth:`pending_buffer`: what this rank sends while its exchange is in flight
        (``parts`` and ``flat`` as :func:`bucket_parts` returns them)."""
        if flat is not None:
            torch.add(self.delta, flat, out=self.pending_buffer())
            return
        for _, seg, e, pos in parts:
            u = self.pending_buffer()[pos : pos + seg.numel()]
            torch.add(seg, e, out=u) if e is not None else u.copy_(seg)

    def owns(self, globals_: dict[str, Tensor]) -> bool:
        return all(map(operator.is_, map(globals_.get, self.names), self.views))  # no generator: no Python call


class Fragment:
    """A part of the model that syncs on its own: its buckets (global copy, flat progress) and place in the cycle.

    Args:
        names: its parameters, in module order.
        start: its place in the cycle before its first step (fragments are staggered over the cycle).

    Example:
        >>> fragment, cycle = Fragment(["w", "b"], start=0), {}
        >>> [fragment.tick(cycle, every=2) for _ in range(4)], cycle
        ([False, True, False, True], {'b|w': 0})
    """

    def __init__(self, names: list[str], start: int) -> None:
        self.names = names
        self.key = "|".join(sorted(names))  # its entry in the state's cycle (checkpointed)
        self.start = start
        self.buckets: list[Bucket] = []
        self._ids: tuple[int, ...] = ()

    def tick(self, cycle: dict[str, int], every: int, now: bool = False) -> bool:
        """One optimizer step: whether the fragment syncs at it (``now``: whatever its place in the cycle)."""
        position = cycle.get(self.key, self.start) + 1
        sync = now or position >= every
        cycle[self.key] = 0 if sync else position
        return sync

    def buckets_of(
        self, params: dict[str, Tensor], globals_: dict[str, Tensor], bucket_bytes: int, place: Callable[..., Any]
    ) -> list[Bucket]:
        """Its buckets, made anew where a parameter is another tensor than before (``place(p)``: where the
        global copy lives, and whether it is pinned)."""
        ids = tuple(map(id, map(params.__getitem__, self.names)))  # no generator: no Python call a tensor
        if ids == self._ids and all([b.owns(globals_) for b in self.buckets]):
            return self.buckets
        groups: list[list[str]] = []
        size = 0
        for n in sorted(self.names, key=lambda n: str(params[n].dtype)):  # stable: order kept per dtype
            p = params[n]
            if not groups or size + 4 * p.numel() > bucket_bytes or p.dtype != params[groups[-1][0]].dtype:
                groups.append([])
                size = 0
            groups[-1].append(n)
            size += 4 * p.numel()
        self.buckets = [Bucket(g, [params[n] for n in g], globals_, *place(params[g[0]])) for g in groups]
        self._ids = ids
        return self.buckets


def fragments_of(names: list[str], params: dict[str, Tensor], config: Any) -> list[Fragment]:
    """The ``config.fragments`` fragments of a group of parameters (one optimizer's), staggered over the cycle.

    Example:
        >>> from lightning_sparse.config import SparseConfig
        >>> params = {n: torch.zeros(4) for n in "abcd"}
        >>> [(f.names, f.start) for f in fragments_of(list(params), params, SparseConfig(fragments=2, sync_every=2))]
        [(['a', 'c'], 1), (['b', 'd'], 0)]
    """
    check_fragments(config.fragments, len(names), "an optimizer")
    parts = split_fragments([(n, params[n].numel()) for n in names], config.fragments, config.fragment_split)
    return [Fragment(part, (len(parts) - 1 - f) * config.sync_every // len(parts)) for f, part in enumerate(parts)]


def progress(p: Tensor, glob: Tensor, e: Tensor | None, out: Tensor | None = None) -> Tensor:
    """``p - (global + e)`` in float32, flat (into ``out``), to the bit as :func:`bucket_parts` makes it."""
    g = glob.reshape(-1)
    seg = torch.empty(p.numel(), dtype=torch.float32, device=p.device) if out is None else out
    if e is not None and e.device != seg.device:
        e = e.to(seg.device)  # an offloaded residual
    if e is not None and g.device == seg.device:
        torch.add(g, e, out=seg)
    else:  # no residual, or offloaded global values: the same sum, float32(g) + e, on the device
        seg.copy_(g)
        if e is not None:
            seg.add_(e)
    torch.sub(p.reshape(-1), seg, out=seg)
    return seg


def _flat_residual(memory: ErrorFeedback, wire: WireContext, plan: BucketPlan, delta: Tensor) -> Tensor | None:
    """The bucket's residuals as one flat tensor (None: offloaded, or a tensor left out of it has one)."""
    layout = residual_layout(wire, plan, delta)
    if memory.held([m.name for (name, _), m in zip(layout, plan.members, strict=True) if name is None]):
        return None
    return memory.flat(layout, delta.device)


@dataclass
class InFlight:
    """An exchange launched and not applied yet (``left``: optimizer steps before it is)."""

    group: tuple[str, ...]
    buckets: list[Bucket]
    futures: list[Future[Average]]
    left: int


class Commit(Protocol):
    """What decides, among groups that may fail, whether an exchange counts: asked before each optimizer step,
    around each exchange, where an exchange in flight arrives and at the hand-over (fault tolerance:
    :class:`~lightning_sparse.exchange.ft.ReplicaCommit`). ``exchange``: the exchange it is given to."""

    exchange: Any

    @property
    def steps(self) -> int: ...
    def before_step(self) -> None: ...
    def close(self) -> None: ...
    def run_exchange(self, exchange: Callable[[], None]) -> None: ...
    def commits_flight(self, flight: InFlight) -> bool: ...
    def run_flush(self, rounds: int | None, flush: Callable[[], None]) -> None: ...


def check_fragments(count: int, tensors: int, holder: str) -> None:
    """Refuse more fragments than ``holder`` (a model, an optimizer) has parameter tensors."""
    if count > 1 and 0 < tensors < count:
        raise ValueError(
            f"fragments={count} is not allowed for {holder} of {tensors} trainable parameter tensors: expected at "
            f"most {tensors} (a fragment holds whole tensors)"
        )


def split_fragments(sizes: list[tuple[str, int]], count: int, how: str = "strided") -> list[list[str]]:
    """Split (name, numel) pairs into ``count`` fragments of about equal size: ``"strided"`` (each to the
    smallest so far) or ``"contiguous"`` (runs cut at equal shares), each in module order.

    Example:
        >>> sizes = [("a", 4), ("b", 4), ("c", 4), ("d", 4)]
        >>> split_fragments(sizes, 2), split_fragments(sizes, 2, "contiguous")
        ([['a', 'c'], ['b', 'd']], [['a', 'b'], ['c', 'd']])
    """
    if how == "strided":
        parts: list[list[str]] = [[] for _ in range(count)]
        totals = [0] * count
        for name, numel in sizes:
            f = totals.index(min(totals))
            parts[f].append(name)
            totals[f] += numel
        return parts
    parts = [[]]
    closed = current = 0
    total = sum(n for _, n in sizes)
    for i, (name, numel) in enumerate(sizes):
        unopened = count - len(parts)
        target = (total - closed) / (unopened + 1)
        if parts[-1] and unopened and (current + numel / 2 > target or len(sizes) - i == unopened):
            parts.append([])
            closed += current
            current = 0
        parts[-1].append(name)
        current += numel
    return parts


def bucket_parts(
    bucket: Bucket, plan: BucketPlan, memory: ErrorFeedback, wire: WireContext
) -> tuple[list[tuple[str, Tensor, Tensor | None, int]], Tensor | None]:
    """``delta = p - (global + e)`` into the bucket's buffer: (name, progress, residual, offset) per
    parameter, as :func:`drop_nonfinite` takes them, and the flat residual where there is one (then in a few
    operators for the whole bucket, bit-identical to one tensor at a time)."""
    delta, glob = bucket.delta, bucket.glob
    params = bucket.flat_params()
    flat = None if params is None else _flat_residual(memory, wire, plan, delta)
    if params is not None and flat is not None:
        if glob.device == delta.device:
            torch.add(glob, flat, out=delta)
        else:  # offloaded global values: float32(global) + e on the device
            delta.copy_(glob)
            delta.add_(flat)
        delta.neg_()  # p + -(global + e) is p - (global + e), to the bit
        torch._foreach_add_(bucket.delta_views, params)
        return [(n, seg, None, 0) for n, seg in zip(bucket.names, bucket.delta_views, strict=True)], flat
    parts: list[tuple[str, Tensor, Tensor | None, int]] = []
    tensors = zip(bucket.names, bucket.params, bucket.views, bucket.delta_views, bucket._regions, strict=True)
    for name, p, g, seg, (pos, _) in tensors:
        e = memory.get(name) if name in memory else None
        if e is not None and e.device != seg.device:
            e = e.to(seg.device)
        progress(p, g, e, out=seg)
        parts.append((name, seg, e, pos))
    return parts, None


def drop_nonfinite(parts: list[tuple[str, Tensor, Tensor | None, int]], warn: Callable[[str], None]) -> None:
    """Zero each non-finite progress of ``parts`` and ``warn(name)``, with one host read per bucket.

    Example:
        >>> seg = torch.tensor([1.0, float("nan")])
        >>> drop_nonfinite([("w", seg, None, 0)], print)
        w
        >>> seg
        tensor([0., 0.])
        >>> drop_nonfinite([("empty", torch.empty(0), None, 0)], print)  # nothing to drop
    """
    parts = [part for part in parts if part[1].numel()]  # an empty shard (FSDP2) has no largest value
    if not parts:
        return
    largest = torch.stack(torch._foreach_norm([seg for _, seg, _, _ in parts], math.inf))
    finite = torch.isfinite(largest)
    if bool(finite.all()):
        return
    for (name, seg, _, _), ok in zip(parts, finite.tolist(), strict=True):
        if not ok:
            seg.zero_()
            warn(name)


def count_local(state: SparseState, bucket: Bucket) -> None:
    """Record a bucket's local step (its fragment not due): what a dense all-reduce would have moved."""
    counters = Counters(numel=bucket.delta.numel())
    count_dense(counters, state.world_size, bucket.delta.numel() * bucket.delta.element_size())
    state.telemetry.record(state.plan(bucket.delta, bucket.params).label, counters, "local step")


def decay_residuals(memory: ErrorFeedback, buckets: list[Bucket], decay: float) -> None:
    """``e = decay * e`` for the buckets' parameters, before their progress joins the residuals at an exchange
    (SparseLoCo's decayed error feedback; what it takes off leaves the process's view)."""
    residuals = [e for bucket in buckets for e in memory.held(bucket.names).values()]
    if residuals:
        torch._foreach_mul_(residuals, decay)
