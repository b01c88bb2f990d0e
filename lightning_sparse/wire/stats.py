"""The counters every collective fills, the telemetry that sums them, the ring byte models and the byte rule.

:func:`sparse_pays` is the byte rule the hook, the density schedules and the telemetry all ask."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

#: the way of sending of the exact hand-over of the residuals (``flush_residuals()``, the end of fit)
FLUSH_METHOD = "dense (flush)"
#: the label of the hand-over's exchanges (``flush_at_end=R``, ``flush_residuals(rounds=R)``)
HAND_OVER = "hand-over"


@dataclass
class Counters:
    """Additive compression figures of one rank (one step, one bucket, or a whole run).

    ``sent_bytes``: what the strategy put into its collectives (values, indices, dense parts, padding);
    ``dense_bytes``: what plain DDP would put into its all-reduce. ``wire_bytes`` and ``dense_wire_bytes``:
    what those collectives, or a dense all-reduce, move through this rank on a ring (0 at world size 1).
    ``dense_buckets``: buckets sent dense, ``fallback_buckets`` of them because sparse would have moved more
    bytes; ``nonfinite_buckets``: those with a non-finite gradient on this rank; ``collectives``: collectives
    issued (coalesced calls count once).

    Example:
        >>> c = Counters(dense_bytes=4000, sent_bytes=80, numel=1000, sent_numel=10)
        >>> c.wire_bytes, c.dense_wire_bytes = 3 * 80, 1.5 * 4000  # 4 ranks: an all-gather of 80 bytes
        >>> c.compression_ratio, c.message_ratio, c.density
        (25.0, 50.0, 0.01)
    """

    dense_bytes: int = 0
    sent_bytes: int = 0
    numel: int = 0
    sent_numel: int = 0
    buckets: int = 0
    dense_buckets: int = 0
    fallback_buckets: int = 0
    nonfinite_buckets: int = 0
    compress_seconds: float = 0.0
    collectives: int = 0
    wire_bytes: float = 0.0
    dense_wire_bytes: float = 0.0

    def add(self, other: Counters) -> None:
        for name in _COUNTER_NAMES:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def __sub__(self, other: Counters) -> Counters:
        """The figures accumulated since ``other`` was a snapshot of these counters."""
        return Counters(**{name: getattr(self, name) - getattr(other, name) for name in _COUNTER_NAMES})

    def copy(self) -> Counters:
        return Counters(**asdict(self))

    @property
    def compression_ratio(self) -> float:
        """Dense wire bytes / wire bytes (1.0 when nothing crossed the wire): :attr:`message_ratio` at 2 ranks,
        below it at more when the messages are all-gathered."""
        return self.dense_wire_bytes / self.wire_bytes if self.wire_bytes else 1.0

    @property
    def message_ratio(self) -> float:
        """Dense bytes / bytes sent: the size of the messages (1.0 when nothing was sent)."""
        return self.dense_bytes / self.sent_bytes if self.sent_bytes else 1.0

    @property
    def density(self) -> float:
        """Fraction of gradient coordinates sent (dense parts count in full)."""
        return self.sent_numel / self.numel if self.numel else 1.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: the fields of :class:`Counters` (``dataclasses.fields`` costs a call per field, at every bucket)
_COUNTER_NAMES = tuple(f.name for f in fields(Counters))


@dataclass
class Telemetry:
    """The hook's running figures: the step in progress, the last finished step, and totals.

    ``groups``: totals per bucket group (a bucket's parameter names); ``methods``: totals per way a bucket
    was sent (the compressor's name, ``"dense (warm-up)"``, ``"dense (fallback)"``, ...);
    ``residual_norm``: the L2 norm of all residuals, measured every ``residual_norm_interval`` steps.

    Example:
        >>> t = Telemetry()
        >>> t.record("fc.weight", Counters(dense_bytes=4000, sent_bytes=80, buckets=1), method="topk")
        >>> t.end_step()
        >>> t.total.message_ratio, t.methods["topk"].sent_bytes, t.steps
        (50.0, 80, 1)
    """

    current: Counters = field(default_factory=Counters)
    last: Counters = field(default_factory=Counters)
    total: Counters = field(default_factory=Counters)
    groups: dict[str, Counters] = field(default_factory=dict)
    methods: dict[str, Counters] = field(default_factory=dict)
    steps: int = 0
    residual_norm: float | None = None
    residual_norm_step: int | None = None
    #: update mode: the unsent part's norm over the parameters' norm, when last measured
    unsent_ratio: float | None = None
    #: ``sparse_fsdp``: bytes FSDP2's collectives inside this process's group moved through it (ring model);
    #: None: not counted (not sharded, or a torch without FSDP2's custom collectives)
    group_bytes: float | None = None
    #: the most wire bytes one optimizer step's exchange moved through this rank (``fragments`` lower it)
    peak_step_wire_bytes: float = 0.0
    #: seconds this rank spent waiting for exchanges to complete (update mode)
    wait_seconds: float = 0.0
    #: while set (the hand-over's exchanges, :data:`HAND_OVER`): appended to every method's name, with no
    #: dense counterpart (dense DDP has nothing to hand over) and no step counted
    label: str | None = None

    def record_group(self, nbytes: float) -> None:
        """Count one collective of FSDP2 inside the group (``nbytes`` through this process)."""
        self.group_bytes = (self.group_bytes or 0.0) + nbytes

    def record(self, group: str, counters: Counters, method: str = "dense") -> None:
        """Add one bucket's figures: to the step in progress, its group and the way it was sent."""
        if self.label is not None:
            counters = replace(counters, dense_bytes=0, dense_wire_bytes=0.0)
            method = f"{method} ({self.label})"
        self.current.add(counters)
        self.groups.setdefault(group, Counters()).add(counters)
        self.methods.setdefault(method, Counters()).add(counters)

    def fold_current(self) -> None:
        """Add what was recorded outside any optimizer step (an end-of-fit flush) to the totals."""
        self.total.add(self.current)
        self.current = Counters()

    def end_step(self) -> None:
        if self.label is None:  # an optimizer step
            self.peak_step_wire_bytes = max(self.peak_step_wire_bytes, self.current.wire_bytes)
            self.last = self.current
            self.steps += 1
        self.fold_current()

    def state_dict(self) -> dict[str, Any]:
        return {
            "total": self.total.as_dict(),
            "groups": {k: v.as_dict() for k, v in self.groups.items()},
            "methods": {k: v.as_dict() for k, v in self.methods.items()},
            "steps": self.steps,
            "group_bytes": self.group_bytes,
            "peak_step_wire_bytes": self.peak_step_wire_bytes,
            "wait_seconds": self.wait_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s totals; counters missing from an older state start at 0."""
        self.total = Counters(**state["total"])
        self.groups = {k: Counters(**v) for k, v in state["groups"].items()}
        self.methods = {k: Counters(**v) for k, v in state.get("methods", {}).items()}
        self.steps = int(state["steps"])
        self.group_bytes = state.get("group_bytes", self.group_bytes)
        self.peak_step_wire_bytes = float(state.get("peak_step_wire_bytes", 0.0))
        self.wait_seconds = float(state.get("wait_seconds", 0.0))
        self.current = Counters()
        self.last = Counters()


def ring_all_reduce_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-reduce of ``nbytes``: ``2*(W-1)/W*nbytes``."""
    return 2.0 * (world - 1) / world * nbytes


def ring_all_gather_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-gather of ``nbytes`` per rank: ``(W-1)*nbytes``."""
    return float((world - 1) * nbytes)


def count_all_reduce(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-reduce of ``nbytes`` this rank issued: the bytes handed to it, and its ring traffic."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += ring_all_reduce_bytes(world, nbytes)


def count_all_gather(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-gather of ``nbytes`` per rank this rank issued."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += ring_all_gather_bytes(world, nbytes)


def count_all_to_all(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-to-all of ``nbytes`` (all W chunks) this rank issued: ``(W-1)/W*nbytes`` leave."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += (world - 1) / world * nbytes if world > 1 else 0.0


def count_dense(counters: Counters, world: int, nbytes: int) -> None:
    """Record ``nbytes`` of gradient that plain DDP would all-reduce, and what that would move."""
    counters.dense_bytes += nbytes
    counters.dense_wire_bytes += ring_all_reduce_bytes(world, nbytes)


def sparse_pays(sparse_wire: float, world: int, dense_bytes: int) -> bool:
    """The byte rule: whether a sparse exchange moving ``sparse_wire`` bytes through each rank moves
    fewer than a dense all-reduce of ``dense_bytes``. At world size 1 dense (exact) is chosen.

    Example:
        >>> sparse_pays(100.0, world=2, dense_bytes=4000), sparse_pays(0.0, world=1, dense_bytes=4000)
        (True, False)
    """
    return sparse_wire < ring_all_reduce_bytes(world, dense_bytes)
