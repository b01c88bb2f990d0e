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
from lightning_sparse.strategies.sharding import (
    FSDP_SETTINGS,
    ShardedFront,
    load_local_optimizer_states,
    local_tree,
    reshard,
    shard_module,
    with_fsdp_settings,
)
from lightning_sparse.strategies.trainer_hooks import TrainerHooks

__all__ = ["FSDP_SETTINGS", "SparseFSDPStrategy", "finish_sharded_setup", "register_fsdp_strategy"]


def _root_step(method: str, context: str, hold_local: bool = False) -> Callable[..., Any]:
    """The strategy's ``method``: the LightningModule's, in the precision context, inside the root unit's forward,
    which starts every unit's all-gathers (a step may call a submodule), as Lightning's DDP runs it in DDP's."""

    def step(self: SparseFSDPStrategy, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        if hold_local:
            self._core.hold_local()
        module = self.lightning_module
        assert module is not None
        with getattr(self.precision_plugin, context)():
            if isinstance(self.model, FSDPModule) and self.model is module:
                return self._forward_redirection(module, module, method, *args, **kwargs)
            return getattr(module, method)(*args, **kwargs)

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


@with_fsdp_settings(ModelParallelStrategy)
class SparseFSDPStrategy(ShardedFront, TrainerHooks, ModelParallelStrategy):
    """FSDP2 inside each group of ``shard_size`` processes, update mode's sparse exchange across groups.

    The processes form a mesh ``("replicate", "shard")``: inside a group FSDP2 shards the model; after each
    optimizer step a process's compressed progress is exchanged with the processes of the other groups holding the
    same shard. The model is sharded by the LightningModule's ``configure_model`` (``fully_shard(module,
    mesh=self.device_mesh["shard"])``) or by the strategy (``sharded_modules``). Checkpoints are
    ``torch.distributed.checkpoint`` folders; resuming needs the same number of processes and ``shard_size``.

    Args:
        shard_size: processes per group, a divisor of the number of processes; None: those of one node.
        sharded_modules: names of module classes to shard (e.g. ``["GPT2Block"]``); None: ``configure_model`` does.
        {settings}
        compression_monitor: add a ``lightning_sparse.CompressionMonitor`` when fitting, unless there is one.

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

    @override
    def setup_environment(self) -> None:
        self._start_mesh(lambda: ParallelStrategy.setup_environment(self))
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if shard_module(self.model, self.device_mesh["shard"], self.sharded_modules, self.model is self._sharded_here):
            self._sharded_here = self.model
        finish_sharded_setup(self, trainer)
        self._bind(self.model)
        self._core.check_optimizers(self.optimizers, self._exchange_size, self.model)

    training_step = _root_step("training_step", "train_step_context", hold_local=True)
    validation_step = _root_step("validation_step", "val_step_context")
    test_step = _root_step("test_step", "test_step_context")
    predict_step = _root_step("predict_step", "predict_step_context")
    # an evaluation's forward leaves the root's parameters gathered (see sharding.reshard)
    on_validation_end = _reshard_after("on_validation_end")
    on_test_end = _reshard_after("on_test_end")
    on_predict_end = _reshard_after("on_predict_end")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """The global model through ``torch.distributed.checkpoint``, each process's own state (its optimizer
        states too: the folder holds one copy of each shard) in its own file beside it."""
        optimizers = [local_tree(state) for state in checkpoint.pop("optimizer_states", [])]
        states = {"optimizer_states": optimizers} if optimizers else None
        checkpoint[CHECKPOINT_KEY] = self._save_sparse(filepath, states, storage_options)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.fabric.strategies.model_parallel import _load_checkpoint

        self._core.hold_global()  # the module's parameters become the checkpoint's global model
        path = Path(self.broadcast(checkpoint_path))
        assert self.lightning_module is not None and self.model is not None
        strict = self.lightning_module.strict_loading
        checkpoint = _load_checkpoint(
            path=path, state={"state_dict": self.model}, strict=strict, weights_only=weights_only
        )
        self._restore_shards(checkpoint, path, weights_only)
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
