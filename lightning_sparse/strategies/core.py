"""The wiring of a sparse strategy, whatever its front end (:class:`SparseCore`), and the registered names."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_sparse.config import SparseConfig
from lightning_sparse.exchange.batchnorm import GlobalBatchNorm
from lightning_sparse.exchange.ft import FrontEndState, ReplicaCommit
from lightning_sparse.exchange.handover import reset_optimizer_states
from lightning_sparse.exchange.hook import sparse_comm_hook
from lightning_sparse.exchange.outer import outer_step_for
from lightning_sparse.exchange.replicas import REPLICA_ARGS, Replicas
from lightning_sparse.exchange.state import SparseState
from lightning_sparse.exchange.update import (
    DEFAULT_BUCKET_BYTES,
    OFFLOAD_BUCKET_BYTES,
    UpdateExchange,
    average_optimizer_states,
)
from lightning_sparse.schedules import ConstantDensity, WarmupDensity
from lightning_sparse.strategies.advice import (
    BATCHNORM_SHARE,
    WARMUP_START,
    check_no_optimizer_momentum,
    has_batchnorm,
    training_advice,
)
from lightning_sparse.strategies.checkpoint import CheckpointPayload
from lightning_sparse.strategies.ddp_args import check_ddp_kwargs
from lightning_sparse.strategies.presets import PRESETS

__all__ = ["FSDP_NAMES", "STRATEGY_NAMES", "SparseCore", "wrap_in_ddp"]

#: the registered names, with their descriptions and fixed arguments (Trainer and Fabric registries)
STRATEGY_NAMES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("sparse_ddp", "sparse DDP (top-k 1% + error feedback), start_method 'popen'", {"start_method": "popen"}),
    ("sparse_ddp_spawn", "sparse DDP, start_method 'spawn'", {"start_method": "spawn"}),
    ("sparse_ddp_fork", "sparse DDP, start_method 'fork'", {"start_method": "fork"}),
    ("sparse_ddp_notebook", "sparse DDP, start_method 'fork'", {"start_method": "fork"}),
    (
        "sparse_ddp_find_unused_parameters_true",
        "sparse DDP with find_unused_parameters=True, start_method 'popen'",
        {"start_method": "popen", "find_unused_parameters": True},
    ),
    (
        "sparse_ddp_spawn_find_unused_parameters_true",
        "sparse DDP with find_unused_parameters=True, start_method 'spawn'",
        {"start_method": "spawn", "find_unused_parameters": True},
    ),
    # the presets: sparse_ddp_1000x, ... (strategies.presets.PRESETS)
    *(
        (f"sparse_ddp_{name}", f"sparse DDP, preset {name!r}: {settings}", {"start_method": "popen", **settings})
        for name, settings in PRESETS.items()
    ),
)
#: the name of ``sparse_fsdp`` (Trainer and Fabric registries)
FSDP_NAMES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("sparse_fsdp", "FSDP2 inside groups, sparse exchange across", {}),
)


def wrap_in_ddp(
    module: torch.nn.Module, device_ids: list[int] | None, ddp_kwargs: dict[str, Any]
) -> DistributedDataParallel:
    """``module`` in ``DistributedDataParallel``, built on the current CUDA stream (Lightning's side stream would
    make every backward cross streams once per parameter)."""
    return DistributedDataParallel(module=module, device_ids=device_ids, **ddp_kwargs)


class SparseCore:
    """The sparse communication of one strategy: config, state, update exchange, DDP arguments, checkpoint payload.

    Args:
        config: the settings.
        ddp_kwargs: further arguments of ``DistributedDataParallel``.

    Example:
        >>> core = SparseCore(SparseConfig(compressor="topk", density=0.05))
        >>> core.config.compress, core.ddp_kwargs["gradient_as_bucket_view"]
        ('update', True)
    """

    def __init__(self, config: SparseConfig, ddp_kwargs: dict[str, Any] | None = None) -> None:
        # update mode's replicas take some of DDP's arguments themselves (init_sync too, where DDP lacks it)
        replicated = config.compress == "update" and not config.fault_tolerant
        extra = check_ddp_kwargs(ddp_kwargs, REPLICA_ARGS if replicated else frozenset())
        self.config = config
        self.state = SparseState(config)
        self.update: UpdateExchange | None = None
        if config.compress == "update":
            offload = config.offload_global or config.offload_residual
            default = OFFLOAD_BUCKET_BYTES if offload else DEFAULT_BUCKET_BYTES
            cap = default if config.bucket_cap_mb is None else int(config.bucket_cap_mb * 1024 * 1024)
            outer = outer_step_for(config.outer_factory)
            commit = ReplicaCommit(config.min_replicas, config.quorum_timeout) if config.fault_tolerant else None
            self.update = UpdateExchange(self.state, bucket_bytes=cap, outer_step=outer, commit=commit)
        self.ddp_kwargs: dict[str, Any] = {**extra, **config.ddp_kwargs}
        #: update mode builds no DistributedDataParallel (but for a fault-tolerant group's own average)
        self.replicated = replicated
        others = sorted(set(extra) - REPLICA_ARGS) if self.replicated else []
        if others:
            raise ValueError(
                f"{others[0]}={extra[others[0]]!r} is not allowed with compress='update': update mode builds no "
                "DistributedDataParallel (each process steps on its own gradient; lightning_sparse.exchange.replicas."
                "Replicas starts the replicas equal and syncs their buffers), so this argument of DDP's reducer would "
                f"do nothing. Allowed there: {', '.join(sorted(REPLICA_ARGS))}; or use compress='gradient'."
            )
        #: the model as :meth:`wrap` replicated it (update mode), once it did
        self.replicas: Replicas | None = None
        self.checkpoint = CheckpointPayload(self.state, self.update)
        self.batchnorm = GlobalBatchNorm(config.batchnorm_batches) if self.update is not None else None
        self._warned_batchnorm = False
        #: the step at which the residuals were last handed over exactly (:meth:`flush_residuals`)
        self._handed_over: int | None = None

    def bind(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        process_group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        device: torch.device,
        scaler: Any = None,
        optimizers: Callable[[], list[Any]] | None = None,
        module: torch.nn.Module | None = None,
        aliases: Iterable[tuple[str, torch.Tensor]] = (),
        job: tuple[dist.ProcessGroup | None, int, int] | None = None,
        recovery: FrontEndState | None = None,
    ) -> None:
        """Bind the exchange to its parameters and process group, with the gradient scaler and, in update mode, the
        optimizers and the ``module`` whose BatchNorm statistics :meth:`global_model` recomputes. ``aliases``: the
        tensors the optimizers hold in place of the exchanged ones (FSDP2's DTensors); ``job``: the whole job's
        group, rank and size (fault-tolerant FSDP2); ``recovery``: the front end's part of a healing group's state."""
        if module is not None:
            self._warm_up_density(module)  # before a checkpoint's schedule state is applied to it
        self.checkpoint.apply_pending(device)
        enabled = scaler is not None and getattr(scaler, "is_enabled", lambda: True)()
        # gradient mode: the residuals carry the loss scale and follow its changes
        self.state.use_scaler(scaler if enabled else None, rescale_residuals=self.update is None)
        if self.update is None:
            self.state.bind(named_parameters, process_group=process_group)
            return
        self.update.bind(named_parameters, process_group=process_group, aliases=aliases)
        if isinstance(self.update.commit, ReplicaCommit):
            self.update.commit.start(*(job or (process_group, rank, world_size)), front_end=recovery)
        if module is not None and self.batchnorm is not None:
            self.batchnorm.attach(module, self.state.step)
        if optimizers is not None:
            update = self.update
            update.on_dense = lambda: average_optimizer_states(optimizers(), process_group)
            # a non-finite update heals: the optimizers forget that parameter's state
            update.on_nonfinite = lambda names: reset_optimizer_states(optimizers(), names, update.name_of)

    def _warm_up_density(self, module: torch.nn.Module) -> None:
        """``batchnorm_warmup``: update mode, a model with BatchNorm, a constant density carrying under
        ``BATCHNORM_SHARE`` of each step's progress."""
        config, schedule = self.config, self.state.schedule
        if self.update is None or not config.batchnorm_warmup or not isinstance(schedule, ConstantDensity):
            return
        density = schedule.density(0)
        if density / config.sync_every >= BATCHNORM_SHARE or density >= WARMUP_START or not has_batchnorm(module):
            return
        self.state.schedule = WarmupDensity(start=WARMUP_START, end=density, steps=config.batchnorm_warmup)
        rank_zero_info(
            f"lightning_sparse: the model has BatchNorm and {density / config.sync_every:g} of each step's "
            f"progress reaches the global model (density={density:g}, sync_every={config.sync_every}): the "
            f"density warms up from {WARMUP_START:g} to {density:g} over the first {config.batchnorm_warmup} "
            "optimizer steps (batchnorm_warmup=0 turns it off)."
        )

    def wrap(
        self, module: torch.nn.Module, device_ids: list[int] | None, ddp_kwargs: dict[str, Any]
    ) -> torch.nn.Module:
        """``module`` made data parallel: in update mode :class:`Replicas` (no reducer), else :func:`wrap_in_ddp`."""
        return Replicas(module, **ddp_kwargs) if self.replicated else wrap_in_ddp(module, device_ids, ddp_kwargs)

    def register_hook(
        self,
        model: torch.nn.Module | None,
        rank: int,
        world_size: int,
        device: torch.device,
        scaler: Any = None,
        optimizers: Callable[[], list[Any]] | None = None,
        recovery: FrontEndState | None = None,
    ) -> None:
        """:meth:`bind` to a model :meth:`wrap` made; in gradient mode register DDP's communication hook."""
        expected = Replicas if self.replicated else DistributedDataParallel
        if not isinstance(model, expected):
            raise RuntimeError(f"expected the model wrapped in {expected.__name__}, got {type(model).__name__}")
        named, group = model.module.named_parameters(), model.process_group
        self.bind(named, group, rank, world_size, device, scaler, optimizers, model.module, recovery=recovery)
        if isinstance(model, Replicas):
            self.replicas = model
        elif self.update is None:
            model.register_comm_hook(self.state, sparse_comm_hook)

    def check_optimizers(self, optimizers: list[Any], world_size: int, module: torch.nn.Module | None = None) -> None:
        """Refuse an optimizer momentum under momentum correction; warn of combinations that train far from dense."""
        if self.config.momentum_correction:
            check_no_optimizer_momentum(optimizers, self.config.momentum_correction)
        if world_size > 1:
            for advice in training_advice(self.state, optimizers, module):
                rank_zero_warn(f"lightning_sparse: {advice}")

    def hold_local(self) -> None:
        """Update mode: let the module hold this rank's own view of every parameter (no-op otherwise)."""
        if self.update is not None:
            self.update.hold_local()

    def hold_global(self) -> None:
        """Update mode: put the global parameters back in the module (no-op otherwise)."""
        if self.update is not None:
            self.update.hold_global()

    def flush_residuals(self, rounds: int | None = None) -> None:
        """Update mode: :meth:`UpdateExchange.flush_residuals`, then :meth:`global_model`."""
        if self.update is None:
            raise ValueError(
                f"flush_residuals() is not allowed with compress={self.config.compress!r}: expected "
                "compress='update' (gradient mode keeps no global model apart from the replicas: its "
                "residuals are gradients still to be sent)"
            )
        if rounds is not None or self._handed_over != self.state.step:  # a second exact flush adds nothing
            self.update.flush_residuals(rounds)
            self.state.telemetry.fold_current()  # a dense flush's bytes, recorded outside any step
            self._handed_over = self.state.step if rounds is None else None
        self.global_model()

    def end_fit(self) -> None:
        """:meth:`flush_residuals` as ``flush_at_end`` says (update mode), else :meth:`global_model`."""
        update, flush = self.update, self.config.flush_at_end
        # plain DDP steps (a timed fallback's dense choice) left nothing unsent: no all-reduce of zeros
        if update is not None and flush is not False and update.active and not self.state.plain_ddp:
            self.flush_residuals(None if flush is True else flush)
        else:
            self.global_model()

    def global_model(self, together: bool = True) -> None:
        """Update mode: give the module the global parameters and BatchNorm statistics recomputed under them,
        averaged over the processes if ``together`` (every process calls it here)."""
        self.hold_global()
        norms, state = self.batchnorm, self.state
        if norms is None or not norms.attached:
            return
        world_size = state.world_size if together else 1
        norms.recompute(state.process_group, world_size, state.telemetry, state.step)
        if norms.fallback and world_size > 1 and not self._warned_batchnorm:
            self._warned_batchnorm = True
            names = ", ".join(norms.fallback[:3]) + (", ..." if len(norms.fallback) > 3 else "")
            rank_zero_warn(
                f"lightning_sparse: {len(norms.fallback)} BatchNorm layer(s) ({names}) ran in training outside "
                "any call the strategy could replay, so the global model's statistics there cannot be "
                "recomputed under its parameters: they are the statistics each process gathered with its own "
                "view, averaged over the processes. Calling the network as a module in training_step "
                "(self(x), self.net(x), self.net(pixel_values=x), self.head(self.backbone(x))) rather than "
                "through its .forward(...) or a functional call lets them be recomputed (see "
                "docs/guarantees.md, 'BatchNorm statistics of the global model')."
            )
