"""SparseFSDPStrategy: FSDP2 inside each group of processes, the sparse exchange across groups (sparse HSDP)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_sparse._utils import check_bool
from lightning_sparse.strategies.checkpoint import CHECKPOINT_KEY
from lightning_sparse.strategies.ft_front import trainer_recovery
from lightning_sparse.strategies.settings import DDP_ONLY, with_settings
from lightning_sparse.strategies.sharding import (
    FSDP_SETTINGS,
    ShardedFront,
    bind_shards,
    check_mesh,
    load_local_optimizer_states,
    local_tree,
    mesh_shape,
    reshard,
    shard_module,
    start_mesh,
)
from lightning_sparse.strategies.trainer_hooks import TrainerHooks

__all__ = ["FSDP_SETTINGS", "SparseFSDPStrategy", "finish_sharded_setup", "register_fsdp_strategy"]


def _root_step(method: str, context: str) -> Callable[..., Any]:
    """The strategy's ``method``: the LightningModule's, in the precision context, inside the root's forward."""

    def step(self: SparseFSDPStrategy, *args: Any, **kwargs: Any) -> Any:
        with getattr(self.precision_plugin, context)():
            return self._in_root(method, *args, **kwargs)

    step.__name__ = step.__qualname__ = method
    return step


def _reshard_after(hook: str) -> Callable[[SparseFSDPStrategy], None]:
    """The strategy's ``hook``: Lightning's, then the model resharded."""

    def run(self: SparseFSDPStrategy) -> None:
        getattr(super(SparseFSDPStrategy, self), hook)()
        if self.model is not None:
            reshard(self.model)

    run.__name__ = run.__qualname__ = hook
    return run


@with_settings(
    exclude=DDP_ONLY,
    docs={"bucket_cap_mb": "size of the exchange's messages in MB (None: 25)."},
    inherit=(ModelParallelStrategy, ("process_group_backend", "timeout")),
)
class SparseFSDPStrategy(ShardedFront, TrainerHooks, ModelParallelStrategy):
    """FSDP2 inside each group of ``shard_size`` processes, update mode's sparse exchange across groups.

    The processes form a mesh ``("replicate", "shard")`` of ``world_size / shard_size`` groups. Inside a group
    FSDP2 shards the model and reduce-scatters the gradients (the fast link); after each process's optimizer step
    its compressed progress is exchanged with the processes of the other groups that hold the same shard (the slow
    link). Parameters, optimizer state, residual and global copy are all shard-sized.

    The model is sharded by the LightningModule's ``configure_model`` (``fully_shard(module,
    mesh=self.device_mesh["shard"])``) or by the strategy (:func:`~lightning_sparse.strategies.sharding.sharding_units`
    of ``sharded_modules``). Every step method runs inside the root unit's forward, so a step may call ``self(x)``
    or a submodule (``self.model(input_ids=x, labels=x)``) whose output exposes its tensors to FSDP2 (a tensor,
    tuple, dict, dataclass or ``ModelOutput``). Checkpoints are ``torch.distributed.checkpoint`` folders (the
    global model) with each process's own state in ``<path>.sparse/``; resuming needs the same number of processes
    and ``shard_size``.

    Args:
        shard_size: processes per group (FSDP2 inside, the exchange across); None (default): the
            processes of one node. Must divide the number of processes.
        sharded_modules: names of module classes to shard (e.g. ``["GPT2Block"]``), for a
            LightningModule without a ``configure_model`` that shards it; None: ``configure_model`` does.
        {settings}
        compression_monitor: add a ``lightning_sparse.CompressionMonitor`` to the Trainer's callbacks when
            fitting, unless it has one. ``False``: none.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> strategy = SparseFSDPStrategy(shard_size=2, sharded_modules=["Block"], sync_every=4, value_bits=2)
        >>> trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy)  # doctest: +SKIP
    """

    def __init__(
        self,
        shard_size: int | None = None,
        sharded_modules: list[str] | None = None,
        *,
        compression_monitor: bool = True,
        **settings: Any,
    ) -> None:
        check_bool("compression_monitor", compression_monitor)
        self._take_sharding(settings, shard_size, sharded_modules)
        super().__init__(**self._take_settings(SparseFSDPStrategy, settings))
        self.compression_monitor = compression_monitor
        self._sharded_here: torch.nn.Module | None = None

    # ------------------------------------------------------------------ mesh
    def _mesh_shape(self) -> list[int]:
        """[groups, shard_size]: what a checkpoint records and a resume must match."""
        return mesh_shape(self.device_mesh)

    @override
    def setup_environment(self) -> None:
        self._device_mesh = start_mesh(self, lambda: ParallelStrategy.setup_environment(self), self._shard_size)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # ------------------------------------------------------------------ sharding and binding
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._shard_model(self.model)
        finish_sharded_setup(self, trainer)
        self._bind()
        self._core.check_optimizers(self.optimizers, int(self.device_mesh["replicate"].size()), self.model)

    def _shard_model(self, module: torch.nn.Module) -> None:
        if shard_module(module, self.device_mesh["shard"], self.sharded_modules, module is self._sharded_here):
            self._sharded_here = module

    # ------------------------------------------------------------------ steps through the root's forward
    # The root unit's forward starts every unit's all-gathers, but a step that calls a submodule (self.model(...))
    # never runs it: every step method runs inside it instead, as Lightning's DDP runs it inside DDP's forward.
    def _in_root(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        module = self.lightning_module
        assert module is not None
        if isinstance(self.model, FSDPModule) and self.model is module:
            return self._forward_redirection(module, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._core.hold_local()
        with self.precision_plugin.train_step_context():
            return self._in_root("training_step", *args, **kwargs)

    validation_step = _root_step("validation_step", "val_step_context")
    test_step = _root_step("test_step", "test_step_context")
    predict_step = _root_step("predict_step", "predict_step_context")
    # an evaluation's forward leaves the root's parameters gathered (see sharding.reshard)
    on_validation_end = _reshard_after("on_validation_end")
    on_test_end = _reshard_after("on_test_end")
    on_predict_end = _reshard_after("on_predict_end")

    def _bind(self) -> None:
        assert self.model is not None
        scaler = getattr(self.precision_plugin, "scaler", None)
        recovery = trainer_recovery(self, sharded=True)
        bind_shards(
            self._core, self.model, self.device_mesh, self.root_device, scaler, lambda: self.optimizers, recovery
        )

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """The global model through ``torch.distributed.checkpoint``, and each process's residuals and optimizer
        state (it followed its own gradients; the folder holds one copy of each shard) in its own file beside it."""
        optimizers = [local_tree(state) for state in checkpoint.pop("optimizer_states", [])]
        entry = self._core.checkpoint.save(
            filepath,
            self.global_rank,
            self.world_size,
            {"optimizer_states": optimizers} if optimizers else None,
            self.checkpoint_io,
            storage_options,
            rank0_in_checkpoint=False,
        )
        entry["mesh"] = self._mesh_shape()
        checkpoint[CHECKPOINT_KEY] = entry
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.fabric.strategies.model_parallel import _load_checkpoint

        self._core.hold_global()  # the module's parameters become the checkpoint's global model
        path = Path(self.broadcast(checkpoint_path))
        assert self.lightning_module is not None
        checkpoint = _load_checkpoint(
            path=path,
            state={"state_dict": self.model},
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )
        check_mesh(checkpoint.get(CHECKPOINT_KEY), self._mesh_shape(), path)
        self._restore_sparse(checkpoint, path, True, weights_only)
        assert self.model is not None
        states = checkpoint.pop("optimizer_states", [])
        load_local_optimizer_states(self.model, list(zip(self.optimizers, states, strict=False)))
        return checkpoint


def finish_sharded_setup(strategy: ModelParallelStrategy, trainer: pl.Trainer) -> None:
    """What Lightning's ``ModelParallelStrategy.setup`` does once the model is sharded."""
    assert strategy.model is not None
    _materialize_distributed_module(strategy.model, strategy.root_device)
    strategy.model = strategy.precision_plugin.convert_module(strategy.model)
    strategy.model_to_device()
    strategy.barrier()
    if trainer.state.fn == TrainerFn.FITTING:
        strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    if trainer.state.fn == TrainerFn.FITTING:
        _optimizers_to_device(strategy.optimizers, strategy.root_device)


def register_fsdp_strategy() -> None:
    """Make ``Trainer(strategy="sparse_fsdp")`` resolve (idempotent)."""
    SparseFSDPStrategy.register_strategies(StrategyRegistry)
