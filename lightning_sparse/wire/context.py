"""What the wire code is given (a bucket's layout, its settings, a call's inputs), and the :class:`Average` back."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.compressors import CompressContext, Compressor
from lightning_sparse.wire.comm import Collectives, Issued
from lightning_sparse.wire.memory import ErrorFeedback, LocalMomentum
from lightning_sparse.wire.stats import Counters


@dataclass(frozen=True)
class Member:
    """One parameter's place in a bucket."""

    name: str
    key: int
    offset: int
    numel: int
    sparse: bool


@dataclass(frozen=True)
class BucketPlan:
    """The layout of one bucket: its members in buffer order, and a label for telemetry."""

    members: tuple[Member, ...]
    numel: int
    label: str

    def __hash__(self) -> int:
        # cached: the layouts cached by plan hash it several times an exchange, at a Python call per member
        found = self.__dict__.get("_hash")
        if found is None:
            found = self.__dict__["_hash"] = hash((self.members, self.numel, self.label))
        return found

    def __getstate__(self) -> dict[str, Any]:
        # a string's hash differs from process to process: the one worked out here stays here
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @functools.cached_property
    def sparse_members(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m.sparse)

    @functools.cached_property
    def sparse_numels(self) -> tuple[int, ...]:
        return tuple(m.numel for m in self.sparse_members)

    @functools.cached_property
    def dense_members(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if not m.sparse)

    @functools.cached_property
    def residual_layout(self) -> tuple[tuple[str | None, int], ...]:
        """The bucket as :meth:`ErrorFeedback.flat <lightning_sparse.wire.memory.ErrorFeedback.flat>` lays
        out its residuals: the sparse members by name, the small tensors (no residual) as ``None``."""
        return tuple((m.name if m.sparse else None, m.numel) for m in self.members)


@dataclass(frozen=True)
class WireContext:
    """The settings and stores the wire code works with on one rank.

    Args:
        compressor: picks the coordinates (its ``pattern`` says how they cross the wire).
        error_feedback: keep what was not sent in ``memory``.
        momentum_correction: DGC's momentum factor (0: off); what was sent is masked in ``velocity``.
        value_dtype: dtype of the values sent (None: the buffer's).
        seed: seed of every shared random choice.
        exchange: ``"auto"``, ``"allgather"`` or ``"split"`` (gather-pattern compressors).
        compact_indices: Rice-code indices wherever that is smaller than int32.
        value_bits: values travel as codes of this many bits (2, 4 or 8) and a scale per 64
            values; None: in ``value_dtype``.
        byte_rule: send a bucket dense where sparse would not move fewer bytes.
        memory: the error-feedback residuals, by parameter name.
        velocity: the local momenta of momentum correction, by parameter name.
        comm: the counted collectives of this rank's process group.
        rank: this rank.
        fixed_buckets: the buckets keep their members across steps and resumes (update mode's; DDP
            lays its buckets out anew after its first step and on resume).

    Built from a :class:`~lightning_sparse.config.SparseConfig` by :func:`wire_context`, which holds the defaults.

    Example:
        >>> from lightning_sparse.compressors import TopK
        >>> ctx = WireContext(TopK(), True, 0.0, None, 0, "auto", True, None, True)
        >>> ctx.world_size, ctx.vdtype(torch.zeros(1, dtype=torch.bfloat16))
        (1, torch.bfloat16)
    """

    # no defaults: they are the config's settings of the same names (:data:`_SETTINGS`)
    compressor: Compressor
    error_feedback: bool
    momentum_correction: float
    value_dtype: torch.dtype | None
    seed: int
    exchange: str
    compact_indices: bool
    value_bits: int | None
    byte_rule: bool
    memory: ErrorFeedback = field(default_factory=ErrorFeedback)
    velocity: LocalMomentum = field(default_factory=LocalMomentum)
    comm: Collectives = field(default_factory=Collectives)
    rank: int = 0
    fixed_buckets: bool = True

    @property
    def world_size(self) -> int:
        return self.comm.world

    @functools.cached_property
    def at_once(self) -> str | None:
        """The bucket-at-once rule that picks exactly what the compressor picks (its ``at_once``), or None."""
        rule = self.compressor.at_once
        return rule if rule is not None and self.compressor.selects_at_once(rule) else None

    def vdtype(self, buffer: Tensor) -> torch.dtype:
        """The dtype the values of ``buffer`` are selected in (float32 under ``value_bits``)."""
        return torch.float32 if self.value_bits is not None else self.value_dtype or buffer.dtype

    def compress_context(self, step: int, m: Member) -> CompressContext:
        return CompressContext(step=step, key=m.key, rank=self.rank, world_size=self.world_size, seed=self.seed)


_SETTINGS = tuple(f.name for f in fields(WireContext) if f.default is MISSING and f.default_factory is MISSING)

#: ``observe(step, bucket label, parameter name, p)``: a density schedule's view of ``p = g + e``
Observer = Callable[[int, str, str, Tensor], None]


@dataclass
class BucketCall:
    """One bucket at one optimizer step.

    Args:
        buffer: the flat sum-ready local input of the bucket's parameters, in their order.
        plan: the bucket's layout.
        step: the optimizer step.
        counters: this call's telemetry (every collective is counted into it).
        sources: float32 tensors sent instead of a member's slice of ``buffer`` (momentum
            correction's local momentum), by name.
        inputs_finite: every input is known to be finite, so the finiteness read is skipped.
        observe: the density schedule's observer, if it observes.
    """

    buffer: Tensor
    plan: BucketPlan
    step: int
    counters: Counters
    sources: dict[str, Tensor] = field(default_factory=dict)
    inputs_finite: bool = False
    observe: Observer | None = None

    def input_of(self, m: Member) -> Tensor:
        """What is compressed for member ``m``: its slice of the buffer, or its source."""
        source = self.sources.get(m.name)
        return source if source is not None else self.buffer[m.offset : m.offset + m.numel]

    def segment(self, m: Member) -> Tensor:
        return self.buffer[m.offset : m.offset + m.numel]


@dataclass
class Pending:
    """A launched part of a bucket's exchange: its futures, and how to add its result.

    ``apply(out)`` adds the average over ranks of this part into ``out`` (laid out like the bucket);
    ``dense`` returns it as the bucket's buffer instead. ``settle`` takes what was sent out of this rank's
    residuals where that is known only once the collectives arrived; :class:`Average` calls it once, before
    the first ``apply``. ``chosen``: each rank chose its own coordinates; ``apply(out, scale)`` then adds
    ``scale`` times the average, or with ``scale`` :data:`BY_COUNT` the count rule.
    """

    futures: list[Issued]
    apply: Callable[..., Any]
    dense: Callable[[], Tensor] | None = None
    settle: Callable[[], None] | None = None
    chosen: bool = False


#: the count rule for the chosen coordinates: a coordinate ``c`` parties chose gets their sum / ``max(c, 2)``
#: (the split exchange, whose owners send sums without counts: x ``max(1, N/2)``)
BY_COUNT = "count"


class Average:
    """The average over ranks of what every rank sent for one bucket, once its collectives completed.

    :meth:`as_dense` gives it in the bucket's buffer (the gradient hook); :meth:`add_to` adds it into
    a tensor (an outer step).
    """

    def __init__(
        self,
        buffer: Tensor,
        parts: list[Pending],
        error: Exception | None = None,
        waits: list[Issued] | None = None,
        parties: int = 1,
    ) -> None:
        self.buffer = buffer
        self.parts = parts
        #: how many processes' parts it averages (the exchange's process group)
        self.parties = parties
        #: the exchange failed (a collective failed or timed out): using the average raises it
        self.error = error
        #: the collectives, waited for on the thread (and CUDA stream) that uses the average
        self.waits = waits or []
        self._settled = False

    def ready(self) -> None:
        """Wait for the collectives; raise the exchange's error where one failed."""
        if self.error is not None:
            raise self.error
        for issued in self.waits:
            issued.wait()
        self.waits = []

    def add_to(self, out: Tensor, chosen_scale: float | str = 1.0) -> Tensor:
        """Add the average into ``out`` (flat, laid out like the bucket; only the coordinates sent are
        touched) and return ``out``. ``chosen_scale``: the factor of the parts of :attr:`Pending.chosen`, or
        :data:`BY_COUNT` (the same as 1 among at most 2 parties)."""
        self.settle()
        if chosen_scale == BY_COUNT and self.parties <= 2:
            chosen_scale = 1.0
        for part in self.parts:
            if part.chosen and chosen_scale != 1.0:
                part.apply(out, chosen_scale)
            else:
                part.apply(out)
        return out

    def settle(self) -> None:
        """Settle this rank's residuals (once): afterwards they hold exactly what this rank did not send."""
        self.ready()
        if self._settled:
            return
        self._settled = True
        for part in self.parts:
            if part.settle is not None:
                part.settle()

    def as_dense(self) -> Tensor:
        """The average as a dense tensor: the bucket's buffer, overwritten."""
        self.ready()
        if len(self.parts) == 1 and self.parts[0].dense is not None:
            return self.parts[0].dense()
        return self.add_to(self.buffer.zero_())


def wire_context(
    config: Any,
    comm: Collectives | None = None,
    rank: int = 0,
    *,
    memory: ErrorFeedback | None = None,
    velocity: LocalMomentum | None = None,
) -> WireContext:
    """The :class:`WireContext` of ``config`` (a :class:`~lightning_sparse.config.SparseConfig`) with this
    rank's stores and collectives.

    Example:
        >>> from lightning_sparse.config import SparseConfig
        >>> ctx = wire_context(SparseConfig(exchange="allgather"))
        >>> ctx.exchange, ctx.world_size
        ('allgather', 1)
    """
    return WireContext(
        **{name: getattr(config, name) for name in _SETTINGS},
        memory=ErrorFeedback() if memory is None else memory,
        velocity=LocalMomentum() if velocity is None else velocity,
        comm=Collectives() if comm is None else comm,
        rank=rank,
        fixed_buckets=config.compress == "update",
    )
