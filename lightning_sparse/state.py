"""SparseState: everything the communication hook keeps between steps."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse._utils import check_int, resolve_value_dtype, stable_key
from lightning_sparse.compressors import Compressor, get_compressor
from lightning_sparse.fallback import TimedFallback, as_fallback
from lightning_sparse.memory import ErrorFeedback, LocalMomentum
from lightning_sparse.patterns import EXCHANGES
from lightning_sparse.schedules import DensitySchedule, as_schedule
from lightning_sparse.stats import Telemetry

STATE_VERSION = 1
#: the places compression can happen (``SparseState(compress=...)``)
COMPRESS_MODES = ("update", "gradient")


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

    @property
    def sparse_members(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m.sparse)

    @property
    def dense_members(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if not m.sparse)


class SparseState:
    """The state of the sparse communication hook on one rank.

    Holds the configuration, the error-feedback residuals (by parameter name), the step
    counter and the telemetry. It contains no process group, so it pickles (``ddp_spawn``);
    :meth:`bind` attaches it to a DDP model's parameters and process group.

    Args:
        compressor: a registered name (``"topk"``, ``"randomk"``, ...) or a Compressor.
        density: a fraction in (0, 1] or a :class:`~lightning_sparse.schedules.DensitySchedule`.
        error_feedback: keep what was not sent and add it to the next gradient.
        min_numel: tensors with fewer elements are sent dense.
        warmup_steps: number of first optimizer steps sent dense (at least 1).
        value_dtype: dtype of the values sent (None: the gradient's dtype).
        seed: seed of every random choice (shared indices, samples).
        fallback_to_dense: ``True`` / ``"bytes"``: send a bucket dense when the sparse exchange
            would move at least as many bytes over the wire as a dense all-reduce of it;
            ``"time"`` or a :class:`~lightning_sparse.fallback.TimedFallback`: that, and send
            every bucket dense when a short trial measures dense steps faster on this link;
            ``False``: never.
        momentum_correction: DGC's momentum correction: keep the momentum ``u <- m*u + g`` of
            each rank's own gradient in the hook, run error feedback on it and zero what was
            sent in ``u`` too; the optimizer must then run without momentum. 0 turns it off.
            Gradient mode only.
        compress: what is compressed: ``"update"`` (each rank's optimizer progress, exchanged
            after its optimizer step; see :mod:`lightning_sparse.update`) or ``"gradient"``
            (the gradient, in DDP's communication hook, before the optimizer step; the
            default here, where the state is used with the hook alone). ``SparseDDPStrategy``
            defaults to ``"update"``.
        exchange: how the selections of top-k-type compressors (``pattern == "gather"``) are
            combined: ``"allgather"`` (every rank gets every rank's pairs: traffic grows with the
            number of ranks), ``"split"`` (a sparse all-reduce: owners of index regions sum and
            re-select, then the global selection is all-gathered; traffic flat in the number of
            ranks), or ``"auto"``: per bucket, the split where it moves at most a quarter
            of the all-gather's bytes (ring model; from about 16 ranks), else the all-gather.
        compact_indices: code the indices of sparse messages with a Rice code on their gaps
            (exact; about 1.1 bytes per index at density 0.01 instead of 4) wherever that is
            smaller than int32.

    Example:
        >>> state = SparseState(compressor="topk", density=0.01)
        >>> state.step
        0
    """

    def __init__(
        self,
        compressor: str | Compressor = "topk",
        density: float | DensitySchedule = 0.01,
        error_feedback: bool = True,
        min_numel: int = 1024,
        warmup_steps: int = 1,
        value_dtype: str | torch.dtype | None = None,
        seed: int = 0,
        fallback_to_dense: bool | str | TimedFallback = True,
        momentum_correction: float = 0.0,
        compress: str = "gradient",
        exchange: str = "auto",
        compact_indices: bool = True,
    ) -> None:
        if compress not in COMPRESS_MODES:
            raise ValueError(
                f"compress={compress!r} is not allowed: expected 'update' (compress each rank's optimizer "
                "update, after its step) or 'gradient' (compress the gradient, before the step)."
            )
        self.compress = compress
        self.compressor = get_compressor(compressor)
        if exchange not in EXCHANGES:
            raise ValueError(
                f"exchange={exchange!r} is not allowed: expected one of {list(EXCHANGES)} ('allgather': every rank "
                "gets every rank's selection; 'split': a sparse all-reduce whose traffic does not grow with the "
                "number of ranks; 'auto': per bucket, the split where it moves at most a quarter of the "
                "all-gather's bytes)."
            )
        if exchange == "split" and self.compressor.pattern != "gather":
            raise ValueError(
                f"exchange='split' is not allowed with compressor={self.compressor!r}: it combines compressors "
                "that pick their own coordinates on each rank (pattern 'gather': topk, rtopk, gaussiank, dgc); "
                f"this one's pattern is {self.compressor.pattern!r}. Use exchange='auto' or 'allgather'."
            )
        self.exchange = exchange
        if not isinstance(compact_indices, bool):
            raise ValueError(f"compact_indices={compact_indices!r} is not allowed: expected True or False.")
        self.compact_indices = compact_indices
        self.schedule = as_schedule(density)
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback={error_feedback!r} is not allowed: expected True or False.")
        self.error_feedback = error_feedback
        self.min_numel = check_int("min_numel", min_numel, minimum=0)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=1)
        self.value_dtype = resolve_value_dtype(value_dtype)
        self.seed = check_int("seed", seed, minimum=0)
        #: the byte rule; ``timed_fallback``: the measured one (None: off)
        self.fallback_to_dense, self.timed_fallback = as_fallback(fallback_to_dense)

        if (
            isinstance(momentum_correction, bool)
            or not isinstance(momentum_correction, (int, float))
            or not 0.0 <= momentum_correction < 1.0
        ):
            raise ValueError(
                f"momentum_correction={momentum_correction!r} is not allowed: expected a number in [0, 1) "
                "(0 turns it off)."
            )
        self.momentum_correction = float(momentum_correction)
        if self.momentum_correction and compress == "update":
            raise ValueError(
                f"momentum_correction={momentum_correction!r} is not allowed with compress='update': each rank's "
                "optimizer keeps its own momentum there and only its update is compressed; use momentum_correction=0, "
                "or compress='gradient' for DGC's momentum correction."
            )
        self.memory = ErrorFeedback()
        self.velocity = LocalMomentum()
        #: per-call: the float32 tensors the hook compresses instead of the bucket's gradient
        self.sources: dict[str, Tensor] = {}
        self.step = 0
        self.telemetry = Telemetry()
        #: the hook measures the residual norm every this many steps (0: never; CompressionMonitor
        #: measures it itself when it logs)
        self.residual_norm_interval = 50
        self.rank = 0
        self.world_size = 1
        self.process_group: dist.ProcessGroup | None = None
        self.in_step = False
        #: set by a caller that makes every input finite before it is exchanged (the update
        #: exchange drops a non-finite update on its rank): the patterns then skip their own
        #: per-tensor check, a read of every input
        self.inputs_finite = False
        #: returns the gradient scaler's current loss scale (set by the strategy under fp16 AMP)
        self.loss_scale: Callable[[], float] | None = None
        self.last_loss_scale: float | None = None
        self._names: dict[int, str] = {}
        self._plans: dict[tuple[int, ...], BucketPlan] = {}

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["process_group"] = None
        state["loss_scale"] = None
        state["sources"] = {}
        state["_names"] = {}
        state["_plans"] = {}
        return state

    # ------------------------------------------------------------------ binding
    def bind(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        process_group: dist.ProcessGroup | None = None,
        check_consistency: bool = True,
    ) -> None:
        """Attach to the parameters (names for residuals) and the process group used to exchange.

        With ``check_consistency`` every rank's configuration is compared (one small collective)
        and a mismatch raises ValueError naming the ranks, instead of hanging in a collective later.
        Then the density schedule is set up (on every rank; it may run collectives, e.g. to
        measure the network for an adaptive density).
        """
        trainable = [(name, p) for name, p in named_parameters if p.requires_grad]
        self._names = {id(p): name for name, p in trainable}
        self._plans = {}
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        else:
            self.rank, self.world_size = 0, 1
        if check_consistency and self.world_size > 1:
            self._check_consistency()
        first = trainable[0][1] if trainable else None
        device = first.device if first is not None else torch.device("cpu")
        self.schedule.setup(self, device, first.dtype if first is not None else torch.float32)
        if self.timed_fallback is not None:
            self.timed_fallback.setup(self, device)

    def fingerprint(self) -> dict[str, Any]:
        """The settings that must agree on every rank."""
        return {
            "compressor": type(self.compressor).__name__,
            "compressor_config": self.compressor.config(),
            "schedule": repr(self.schedule),
            "error_feedback": self.error_feedback,
            "min_numel": self.min_numel,
            "warmup_steps": self.warmup_steps,
            "value_dtype": str(self.value_dtype),
            "seed": self.seed,
            "fallback_to_dense": self.fallback_to_dense,
            "timed_fallback": repr(self.timed_fallback),
            "momentum_correction": self.momentum_correction,
            "compress": self.compress,
            "exchange": self.exchange,
            "compact_indices": self.compact_indices,
            "step": self.step,
            "parameters": sorted(self._names.values()),
        }

    def _check_consistency(self) -> None:
        mine = json.dumps(self.fingerprint(), sort_keys=True, default=str)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.process_group)
        if any(g != gathered[0] for g in gathered):
            first = json.loads(gathered[0])
            diffs = []
            for rank, g in enumerate(gathered):
                other = json.loads(g)
                for key in first:
                    if other.get(key) != first[key]:
                        diffs.append(f"{key}: rank 0 has {first[key]!r}, rank {rank} has {other.get(key)!r}")
            raise ValueError(
                "SparseDDPStrategy is configured differently across ranks; every rank must use the same "
                "settings or the collectives would hang or mix mismatched data. Differences: " + "; ".join(diffs)
            )

    def plan(self, buffer: Tensor, params: list[Tensor]) -> BucketPlan:
        """The (cached) layout of a bucket, from its parameters in buffer order."""
        ids = tuple(id(p) for p in params)
        plan = self._plans.get(ids)
        if plan is None:
            members = []
            offset = 0
            for p in params:
                name = self._names.get(id(p))
                if name is None:
                    raise RuntimeError(
                        "the communication hook got a parameter it was not bound to; "
                        "call SparseState.bind() with the model's named_parameters()"
                    )
                n = p.numel()
                members.append(Member(name, stable_key(name), offset, n, n >= self.min_numel and n > 0))
                offset += n
            if offset != buffer.numel():
                raise RuntimeError(f"bucket buffer has {buffer.numel()} elements but its parameters have {offset}")
            names = [m.name for m in members]
            label = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} tensors)"
            plan = BucketPlan(tuple(members), offset, label)
            self._plans[ids] = plan
        return plan

    def measure_residual_norm(self) -> float:
        """The L2 norm of this rank's residuals after the last finished step (one read of each).

        Records it in ``telemetry.residual_norm`` / ``residual_norm_step`` and returns it.
        """
        norm = self.memory.norm_sq() ** 0.5
        self.telemetry.residual_norm = norm
        self.telemetry.residual_norm_step = self.step - 1
        return norm

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: residuals by parameter name, step, schedule and telemetry totals."""
        return {
            "version": STATE_VERSION,
            "compress": self.compress,
            "exchange": self.exchange,
            "compact_indices": self.compact_indices,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "compressor": type(self.compressor).__name__,
            "compressor_config": self.compressor.config(),
            "schedule": self.schedule.state_dict(),
            "residuals": self.memory.state_dict(),
            "velocity": self.velocity.state_dict(),
            "last_loss_scale": self.last_loss_scale,
            "telemetry": self.telemetry.state_dict(),
            "timed_fallback": None if self.timed_fallback is None else self.timed_fallback.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore what :meth:`state_dict` returned (residuals move to ``device``)."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"cannot load sparse hook state of version {version!r}; expected {STATE_VERSION}")
        self.step = int(state["step"])
        self.schedule.load_state_dict(state["schedule"])
        self.memory.load_state_dict(state["residuals"], device=device)
        self.velocity.load_state_dict(state.get("velocity", {}), device=device)
        self.last_loss_scale = state.get("last_loss_scale")
        self.telemetry.load_state_dict(state["telemetry"])
        timed = state.get("timed_fallback")
        if self.timed_fallback is not None and timed is not None:
            self.timed_fallback.load_state_dict(timed)
