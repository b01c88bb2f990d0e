"""The one owner of a rank's exchange (:class:`SparseState`): settings, residuals, layout, telemetry, counters.

:mod:`~lightning_sparse.exchange.step` exchanges one bucket with it, as torch's PowerSGD hook does with its state.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse._utils import check_same_everywhere, stable_key
from lightning_sparse.compressors import Compressor
from lightning_sparse.config import SparseConfig
from lightning_sparse.exchange.amp import SkippedSteps
from lightning_sparse.exchange.fallback import TimedFallback
from lightning_sparse.schedules import DensitySchedule
from lightning_sparse.wire import BucketPlan, Collectives, Member, count_all_gather, count_all_reduce
from lightning_sparse.wire.context import wire_context
from lightning_sparse.wire.memory import ErrorFeedback, LocalMomentum, sum_of_squares
from lightning_sparse.wire.stats import Counters, Telemetry

__all__ = ["BucketPlan", "ExchangeError", "Member", "SparseState"]


class ExchangeError(RuntimeError):
    """A collective of the sparse exchange failed or timed out: the message says where and what to check.

    Example:
        >>> str(ExchangeError(1, 2, "update", "the exchange of w", "all-gather", "timed out"))[:40]
        'lightning_sparse: rank 1 of 2 (update mo'
    """

    def __init__(self, rank: int, world_size: int, mode: str, where: str, what: str, cause: str) -> None:
        super().__init__(
            f"lightning_sparse: rank {rank} of {world_size} ({mode} mode): {where} failed in "
            f"its {what}: {cause}. Another rank did not take part in time: one may have stopped, crashed or be "
            "stalled (look at its log for an earlier error and at the last step it reached), or the process "
            "group's timeout is too short for this link (SparseDDPStrategy(timeout=datetime.timedelta(...)); "
            "Lightning's default is 30 minutes)."
        )


STATE_VERSION = 1


class SparseState:
    """Everything one rank's exchange keeps: settings, residuals, telemetry, the step counters, this rank's density
    schedule and timed fallback, the process group (none until :meth:`bind`: it pickles for ``ddp_spawn``);
    :mod:`~lightning_sparse.exchange.step` exchanges a bucket with it (a step: :meth:`begin`, buckets, :meth:`close`).

    Args:
        config: the settings (a :class:`~lightning_sparse.config.SparseConfig`); ``compress`` defaults to
            ``"gradient"`` here.
        **settings: the settings, when ``config`` is None.

    Example:
        >>> state = SparseState(compressor="topk", density=0.01)
        >>> state.step, state.config.compress, state.in_step, state.plain_ddp
        (0, 'gradient', False, False)
    """

    def __init__(self, config: SparseConfig | None = None, **settings: Any) -> None:
        if config is None:
            config = SparseConfig(**{"compress": "gradient", **settings})  # a state used with the hook alone
        elif settings:
            raise ValueError(f"SparseState takes a config or settings, not both (got settings {sorted(settings)}).")
        self.config = config
        self.compressor: Compressor = config.compressor  # type: ignore[assignment]
        self.memory = ErrorFeedback()
        self.memory.home = torch.device("cpu") if config.offload_residual else None
        self.velocity = LocalMomentum()
        self.telemetry = Telemetry()
        #: this rank's own copy of the config's ``density`` schedule (it learns as the run goes)
        self.schedule: DensitySchedule = copy.deepcopy(config.schedule)
        #: the timed fallback of this rank's exchange (a copy of the config's), None where it is off
        self.timed_fallback: TimedFallback | None = copy.deepcopy(config.timed_fallback)
        #: the timed fallback times whole steps (update mode, ``sync_every`` 1) up to :meth:`mark_end`
        self.times_whole_steps = (
            self.timed_fallback is not None and config.compress == "update" and config.sync_every == 1
        )
        self.step = 0  # optimizer steps this rank finished exchanging (saved in checkpoints)
        self.optimizer_step = 0  # optimizer steps this rank finished, with or without an exchange
        self.residual_norm_interval = 50  # steps between measurements of the residual norm (0: never)
        self.skips: SkippedSteps | None = None
        self.use_collectives(Collectives(), 0)  # the wire context: no process group until bind
        self.process_group: dist.ProcessGroup | None = None
        self.cycle: dict[str, int] = {}  # update mode: optimizer steps since the last exchange, per fragment
        self.backward: Any = None  # gradient mode: the hook's BackwardBatch of the backward pass under way
        self.in_step = False  # a step is open (begun, its last bucket not exchanged yet)
        self.plain_ddp = False  # update mode with a timed fallback: this step is a plain DDP step
        self._loss_scale: Callable[[], float] | None = None
        self._last_loss_scale: float | None = None
        self._names: dict[int, str] = {}
        self._params: list[Tensor] = []
        self._plans: dict[tuple[int, ...], BucketPlan] = {}
        self.routes: dict[tuple[Any, ...], Any] = {}  # the buckets' routes, by plan, density, dtype and group size

    @property
    def step_exchange(self) -> SparseState:
        """Deprecated: the state itself, which owns the step's exchange."""
        warnings.warn(
            "SparseState.step_exchange is deprecated: the state owns the step's exchange; use the state itself "
            "(and lightning_sparse.exchange.step.bucket(state, ...) for a bucket).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self

    @property
    def parameters(self) -> list[Tensor]:
        """The parameters the state is bound to, in the order :meth:`bind` got them."""
        return self._params

    @property
    def shares_gradients(self) -> bool:
        """Update mode: whether this step's gradients cross the wire (a plain DDP step, fp16's overflow check)."""
        return self.plain_ddp or self.skips is not None

    @property
    def last_loss_scale(self) -> float | None:
        """The gradient scaler's loss scale at the last step's start (gradient mode under fp16)."""
        return self._last_loss_scale

    def __getstate__(self) -> dict[str, Any]:
        unbound: dict[str, Any] = {"_names": {}, "_params": [], "_plans": {}, "routes": {}, "_loss_scale": None}
        unbound.update(process_group=None, skips=None, backward=None, world_size=1)
        return {**self.__dict__, **unbound, "wire": dataclasses.replace(self.wire, comm=Collectives())}

    def bind(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        process_group: dist.ProcessGroup | None = None,
        check_consistency: bool = True,
        trainable_only: bool = True,
    ) -> None:
        """Attach to the parameters (names for residuals) and the process group; every rank at the same point.
        ``check_consistency``: compare every rank's settings (a mismatch raises, rather than hang later);
        ``trainable_only``: skip parameters that do not require gradients."""
        trainable = [(name, p) for name, p in named_parameters if p.requires_grad or not trainable_only]
        self._names = {id(p): name for name, p in trainable}
        self._params = [p for _, p in trainable]
        self._plans, self.routes = {}, {}
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        else:
            rank, world = 0, 1
        self.use_collectives(Collectives(process_group, world), rank)
        if check_consistency and self.world_size > 1:
            check_same_everywhere(self.fingerprint(), self.process_group, self.world_size)
        first = trainable[0][1] if trainable else None
        device = first.device if first is not None else torch.device("cpu")
        self.schedule.setup(self.wire, device, first.dtype if first is not None else torch.float32)
        if self.timed_fallback is not None:
            self.timed_fallback.setup(process_group, self.world_size, self.config.warmup_steps, device)

    def use_collectives(self, comm: Collectives, rank: int) -> None:
        """Exchange through ``comm`` (this rank's counted collectives) as rank ``rank``."""
        #: what the wire code works with on this rank (settings, stores, counted collectives)
        self.wire = wire_context(self.config, comm, rank, memory=self.memory, velocity=self.velocity)
        self.rank, self.world_size = rank, comm.world  # in the group bound (0 and 1 before :meth:`bind`)

    def use_scaler(self, scaler: Any, rescale_residuals: bool) -> None:
        """fp16 AMP: ``scaler``'s skipped steps change nothing; ``rescale_residuals``: follow its loss scale."""
        self.skips = None if scaler is None else SkippedSteps(scaler)
        self._loss_scale = self.skips.scale if self.skips is not None and rescale_residuals else None

    def begin(self) -> None:
        """Open an optimizer step: before its first bucket (a timed update-mode step: before its forward)."""
        self.in_step = True
        if self.skips is not None:
            self.skips.begin()
        if self._loss_scale is not None:  # the residuals carry the loss scale: follow it (powers of 2: exact)
            scale = float(self._loss_scale())
            last = self._last_loss_scale
            if last is not None and scale != last and last > 0:
                self.memory.scale_(scale / last)
                self.velocity.scale_(scale / last)
            self._last_loss_scale = scale
        timed = self.timed_fallback
        if timed is not None:
            sent = timed.begin_step(self.step)  # may agree on a trial: one collective, before the first bucket
            if sent:
                counters = Counters()
                count_all_reduce(counters, self.world_size, sent)
                self.telemetry.record("timed fallback", counters, "timed fallback")

    def close(self) -> None:
        """Close the open step after its last bucket: the schedule's and telemetry's end, the counters on."""
        if not self.in_step:
            return
        self.in_step = False
        interval = self.residual_norm_interval
        if self.config.error_feedback and interval > 0 and self.step % interval == 0:
            self.telemetry.residual_norm = self.memory.norm_sq() ** 0.5
            self.telemetry.residual_norm_step = self.step
        # after the step's collectives, on this thread; only a schedule that observes has a step to end
        schedule_bytes = self.schedule.end_step(self.step) if self.schedule.observes else 0
        if schedule_bytes:
            counters = Counters()
            count_all_gather(counters, self.world_size, schedule_bytes)
            self.telemetry.record("density schedule", counters, "density schedule")
        self.telemetry.end_step()
        self.step += 1
        self.optimizer_step += 1

    def end_unexchanged(self) -> None:
        """Close an optimizer step that exchanged nothing; the exchange counter stays."""
        self.telemetry.end_step()
        self.optimizer_step += 1

    def mark_end(self) -> None:
        """The optimizer step's exchange is over (the timed fallback's window closes here)."""
        if self.times_whole_steps and self.timed_fallback is not None:
            self.timed_fallback.mark_end()

    def error(self, where: str, what: str, cause: str) -> ExchangeError:
        return ExchangeError(self.rank, self.world_size, self.config.compress, where, what, cause)

    def fingerprint(self) -> dict[str, Any]:
        """The settings that must agree on every rank, with the step and the parameter names."""
        return {**self.config.fingerprint(), "step": self.step, "parameters": sorted(self._names.values())}

    def plan(self, buffer: Tensor, params: list[Tensor]) -> BucketPlan:
        """The (cached) layout of a bucket, from its parameters in buffer order."""
        ids = tuple(map(id, params))
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
                members.append(Member(name, stable_key(name), offset, n, n >= self.config.min_numel and n > 0))
                offset += n
            if offset != buffer.numel():
                raise RuntimeError(f"bucket buffer has {buffer.numel()} elements but its parameters have {offset}")
            names = [m.name for m in members]
            label = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} tensors)"
            plan = self._plans[ids] = BucketPlan(tuple(members), offset, label)
        return plan

    def measure_residual_norm(self) -> float:
        """The L2 norm of this rank's residuals, recorded in ``telemetry.residual_norm``."""
        norm = self.memory.norm_sq() ** 0.5
        self.telemetry.residual_norm = norm
        self.telemetry.residual_norm_step = self.step - 1
        return norm

    @torch.no_grad()
    def measure_unsent_ratio(self) -> float | None:
        """Update mode: the norm of the unsent part over the parameters' (None in gradient mode or unbound),
        recorded in ``telemetry.unsent_ratio``."""
        if self.config.compress != "update" or not self._params:
            return None
        params_sq = sum_of_squares(list(self._params))
        ratio = (self.memory.norm_sq() / params_sq) ** 0.5 if params_sq > 0 else 0.0
        self.telemetry.unsent_ratio = ratio
        return ratio

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """This rank's state (``copy=False``: the residuals on the CPU themselves, not copies)."""
        return {
            "version": STATE_VERSION,
            "compress": self.config.compress,
            "exchange": self.config.exchange,
            "compact_indices": self.config.compact_indices,
            "step": self.step,
            "optimizer_step": self.optimizer_step,
            "last_loss_scale": self._last_loss_scale,
            "cycle": dict(self.cycle),
            "rank": self.rank,
            "world_size": self.world_size,
            "compressor": type(self.compressor).__name__,
            "compressor_config": self.compressor.config(),
            "schedule": self.schedule.state_dict(),
            "residuals": self.memory.state_dict(copy),
            "velocity": self.velocity.state_dict(copy),
            "telemetry": self.telemetry.state_dict(),
            "timed_fallback": None if self.timed_fallback is None else self.timed_fallback.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore what :meth:`state_dict` returned (residuals move to ``device``)."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"cannot load sparse hook state of version {version!r}; expected {STATE_VERSION}")
        self.step = int(state["step"])
        self.optimizer_step = int(state.get("optimizer_step", self.step))
        self._last_loss_scale = state.get("last_loss_scale")
        self.cycle = {str(k): int(v) for k, v in state.get("cycle", {}).items()}
        self.schedule.load_state_dict(state["schedule"])
        self.memory.load_state_dict(state["residuals"], device=device)
        self.velocity.load_state_dict(state.get("velocity", {}), device=device)
        self.telemetry.load_state_dict(state["telemetry"])
        if self.timed_fallback is not None and state.get("timed_fallback") is not None:
            self.timed_fallback.load_state_dict(state["timed_fallback"])
