"""What the sparse exchange keeps between steps on one rank: settings, residuals, layout, telemetry."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse._utils import stable_key
from lightning_sparse.compressors import Compressor
from lightning_sparse.config import SparseConfig
from lightning_sparse.exchange.fallback import TimedFallback
from lightning_sparse.exchange.step import StepExchange
from lightning_sparse.schedules import DensitySchedule
from lightning_sparse.wire import BucketPlan, Collectives, Member, WireContext
from lightning_sparse.wire.memory import ErrorFeedback, LocalMomentum, sum_of_squares
from lightning_sparse.wire.stats import Telemetry

__all__ = ["BucketPlan", "Member", "SparseState"]

STATE_VERSION = 1
#: the one setting whose default differs here: a state used with the hook alone compresses gradients
HOOK_DEFAULTS: dict[str, Any] = {"compress": "gradient"}


class SparseState:
    """The state of the sparse exchange on one rank: settings, residuals, telemetry and the step's exchange.

    It holds no process group until :meth:`bind`, so it pickles (``ddp_spawn``).

    Args:
        config: the settings (a :class:`~lightning_sparse.config.SparseConfig`); ``compress`` defaults to
            ``"gradient"`` here.
        **settings: the settings, when ``config`` is None.

    Example:
        >>> state = SparseState(compressor="topk", density=0.01)
        >>> state.step, state.config.compress
        (0, 'gradient')
    """

    def __init__(self, config: SparseConfig | None = None, **settings: Any) -> None:
        if config is None:
            config = SparseConfig(**{**HOOK_DEFAULTS, **settings})
        elif settings:
            raise ValueError(f"SparseState takes a config or settings, not both (got settings {sorted(settings)}).")
        self.config = config
        self.compressor: Compressor = config.compressor  # type: ignore[assignment]
        self.memory = ErrorFeedback()
        if config.offload_residual:
            self.memory.home = torch.device("cpu")
        self.velocity = LocalMomentum()
        self.telemetry = Telemetry()
        self.step_exchange = StepExchange(config, self.memory, self.velocity, self.telemetry)
        self.process_group: dist.ProcessGroup | None = None
        #: update mode: optimizer steps since the last exchange, per group of parameters
        self.cycle: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._params: list[Tensor] = []
        self._plans: dict[tuple[int, ...], BucketPlan] = {}

    @property
    def schedule(self) -> DensitySchedule:
        """This rank's density schedule (:attr:`StepExchange.schedule`: a copy of the config's ``density``)."""
        return self.step_exchange.schedule

    @property
    def timed_fallback(self) -> TimedFallback | None:
        """This rank's timed fallback (:attr:`StepExchange.timed_fallback`), or None."""
        return self.step_exchange.timed_fallback

    @property
    def step(self) -> int:
        """Optimizer steps this rank finished exchanging (:attr:`StepExchange.step`)."""
        return self.step_exchange.step

    @property
    def rank(self) -> int:
        """This rank in the process group the state is bound to (0 before :meth:`bind`)."""
        return self.step_exchange.wire.rank

    @property
    def world_size(self) -> int:
        """The processes of that group (1 before :meth:`bind`)."""
        return self.step_exchange.world_size

    @property
    def parameters(self) -> list[Tensor]:
        """The parameters the state is bound to, in the order :meth:`bind` got them."""
        return self._params

    @property
    def wire(self) -> WireContext:
        """What the wire code works with on this rank (settings, stores, counted collectives)."""
        return self.step_exchange.wire

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["process_group"] = None
        state["_names"] = {}
        state["_params"] = []
        state["_plans"] = {}
        return state

    def bind(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        process_group: dist.ProcessGroup | None = None,
        check_consistency: bool = True,
        trainable_only: bool = True,
    ) -> None:
        """Attach to the parameters (names for residuals) and the process group; every rank at the same point.

        ``check_consistency``: compare every rank's settings (a mismatch raises, rather than hang later).
        ``trainable_only``: skip parameters that do not require gradients.
        """
        trainable = [(name, p) for name, p in named_parameters if p.requires_grad or not trainable_only]
        self._names = {id(p): name for name, p in trainable}
        self._params = [p for _, p in trainable]
        self._plans = {}
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        else:
            rank, world = 0, 1
        self.step_exchange.bind(Collectives(process_group, world), rank)
        if check_consistency and self.world_size > 1:
            self._check_consistency()
        first = trainable[0][1] if trainable else None
        device = first.device if first is not None else torch.device("cpu")
        self.schedule.setup(self.wire, device, first.dtype if first is not None else torch.float32)
        timed = self.timed_fallback
        if timed is not None:
            timed.setup(process_group, self.world_size, self.config.warmup_steps, device)

    def fingerprint(self) -> dict[str, Any]:
        """The settings that must agree on every rank, with the step and the parameter names."""
        return {**self.config.fingerprint(), "step": self.step, "parameters": sorted(self._names.values())}

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
            plan = BucketPlan(tuple(members), offset, label)
            self._plans[ids] = plan
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
        timed = self.timed_fallback
        return {
            "version": STATE_VERSION,
            "compress": self.config.compress,
            "exchange": self.config.exchange,
            "compact_indices": self.config.compact_indices,
            **self.step_exchange.state_dict(),
            "cycle": dict(self.cycle),
            "rank": self.rank,
            "world_size": self.world_size,
            "compressor": type(self.compressor).__name__,
            "compressor_config": self.compressor.config(),
            "schedule": self.schedule.state_dict(),
            "residuals": self.memory.state_dict(copy),
            "velocity": self.velocity.state_dict(copy),
            "telemetry": self.telemetry.state_dict(),
            "timed_fallback": None if timed is None else timed.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore what :meth:`state_dict` returned (residuals move to ``device``)."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"cannot load sparse hook state of version {version!r}; expected {STATE_VERSION}")
        self.step_exchange.load_state_dict(state)
        self.cycle = {str(k): int(v) for k, v in state.get("cycle", {}).items()}
        self.schedule.load_state_dict(state["schedule"])
        self.memory.load_state_dict(state["residuals"], device=device)
        self.velocity.load_state_dict(state.get("velocity", {}), device=device)
        self.telemetry.load_state_dict(state["telemetry"])
        saved_timed = state.get("timed_fallback")
        timed = self.timed_fallback
        if timed is not None and saved_timed is not None:
            timed.load_state_dict(saved_timed)
