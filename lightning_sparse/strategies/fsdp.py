"""SparseFSDPStrategy: FSDP2 inside each group of processes, the sparse exchange across groups (sparse HSDP)."""

from __future__ import annotations

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
from lightning_sparse.strategies.core import FSDP_NAMES, SparseCore
from lightning_sparse.strategies.ft_front import trainer_recovery
from lightning_sparse.strategies.settings import DDP_ONLY, take_settings, with_settings
from lightning_sparse.strategies.sharding import (
    FSDP_SETTINGS,
    bind_shards,
    check_mesh,
    check_sharding_arguments,
    load_local_optimizer_states,
    local_tree,
    mesh_shape,
    reshard,
    shard_module,
    start_mesh,
)
from lightning_sparse.strategies.trainer_hooks import TrainerHooks

__all__ = ["FSDP_SETTINGS", "SparseFSDPStrategy", "finish_sharded_setup", "register_fsdp_strategy"]


@with_settings(
    exclude=DDP_ONLY,
    docs={"bucket_cap_mb": "size of the exchange's messages in MB (None: 25)."},
    inherit=(ModelParallelStrategy, ("process_group_backend", "timeout")),
)
class SparseFSDPStrategy(TrainerHooks, ModelParallelStrategy):
    """FSDP2 inside each group of ``shard_size`` processes, update mode's sparse exchange across groups.

    The processes form a 2-D device mesh ``("replicate", "shard")``: ``world_size / shard_size``
    groups of ``shard_size``. Inside a group the model is sharded with FSDP2's ``fully_shard`` on the
    ``"shard"`` dimension and gradients are reduce-scattered as usual (the fast link). Every process
    steps its own optimizer on its shards; after the step the compressed part of its progress is
    exchanged across the ``"replicate"`` dimension, with the process of every other group that holds
    the same shard (the slow link), with every setting of update mode. ``shard_size`` equal to the
    number of processes is plain FSDP2, with nothing to exchange. Parameters, optimizer state,
    residual and global copy are all shard-sized on every process.

    The model is sharded either by the LightningModule's ``configure_model``, which calls
    ``fully_shard(module, mesh=self.device_mesh["shard"])`` itself (as with Lightning's
    ``ModelParallelStrategy``), or by the strategy: every module whose class is named in
    ``sharded_modules``, then every direct child of the LightningModule around such blocks that holds
    parameters they do not (``self.model``), then the LightningModule itself with whatever is left. A
    module that shares a parameter with a module outside it (tied input and output embeddings) is not a
    unit of its own: the parameter stays with the unit around both. Where the LightningModule is a unit
    (sharded here, or by ``configure_model``), ``training_step``, ``validation_step``, ``test_step`` and
    ``predict_step`` run inside its forward, so FSDP2 gathers what it holds whether a step calls
    ``self(x)`` or a submodule (``self.model(input_ids=x, labels=x)``, as with Hugging Face models). A
    submodule's output must expose its tensors to FSDP2 (a tensor, tuple, dict, dataclass or Hugging
    Face ``ModelOutput``). Fit, then validate, test and predict on the same Trainer, as usual.
    Checkpoints are folders of ``torch.distributed.checkpoint`` (the global model, written once, each
    shard by one process) with each process's residuals and optimizer state in a file of its own
    beside them (``<path>.sparse/``); ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
    turns the folder into one ``torch.save`` file for inference. Resuming needs the same number of
    processes and ``shard_size``.

    Args:
        shard_size: processes per group (FSDP2 inside, the exchange across); None (default): the
            processes of one node. Must divide the number of processes.
        sharded_modules: names of module classes to shard (e.g. ``["GPT2Block"]``), for a
            LightningModule without a ``configure_model`` that shards it; None: ``configure_model`` does.
        {settings}
        compression_monitor: add a ``lightning_sparse.CompressionMonitor`` to the Trainer's callbacks when
            fitting, unless it already has one. ``False`` adds nothing.

    Example:
        >>> import lightning_sparse
        >>> from lightning.pytorch import Trainer
        >>> strategy = SparseFSDPStrategy(shard_size=2, sharded_modules=["Block"], sync_every=4, value_bits=2)
        >>> trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy)  # doctest: +SKIP
    """

    strategy_name = "sparse_fsdp"
    _names = FSDP_NAMES

    def __init__(
        self,
        shard_size: int | None = None,
        sharded_modules: list[str] | None = None,
        *,
        compression_monitor: bool = True,
        **settings: Any,
    ) -> None:
        check_bool("compression_monitor", compression_monitor)
        check_sharding_arguments(settings, shard_size, sharded_modules)
        config, lightning_args, _ = take_settings(SparseFSDPStrategy, settings)
        self._core = SparseCore(config)
        super().__init__(**lightning_args)
        self.compression_monitor = compression_monitor
        self._shard_size = shard_size
        self.sharded_modules = None if sharded_modules is None else list(sharded_modules)
        self._sharded_here: torch.nn.Module | None = None

    # ------------------------------------------------------------------ mesh
    @property
    def shard_size(self) -> int:
        """Processes per group (the mesh's ``"shard"`` dimension)."""
        return int(self.device_mesh["shard"].size())

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
    # FSDP2 all-gathers a unit's parameters in that unit's forward, and the root unit (the
    # LightningModule, sharded last) also starts every forward and backward of all the units. A
    # training_step that calls a submodule (self.model(...)) never runs the LightningModule's forward:
    # every step method runs inside it instead, as Lightning's DDP runs it inside DDP's forward.
    def _root_step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        module = self.lightning_module
        assert module is not None
        if isinstance(self.model, FSDPModule) and self.model is module:
            return self._forward_redirection(module, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._core.hold_local()  # as TrainerHooks.training_step: the forward runs on this process's view
        with self.precision_plugin.train_step_context():
            return self._root_step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._root_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._root_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._root_step("predict_step", *args, **kwargs)

    # the root keeps its gathered parameters after an evaluation's forward (no backward frees them):
    # shard it again, so that the next forward gathers what the shards hold by then
    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.model is not None:
            reshard(self.model)

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        if self.model is not None:
            reshard(self.model)

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        if self.model is not None:
            reshard(self.model)

    def _bind(self) -> None:
        assert self.model is not None
        scaler = getattr(self.precision_plugin, "scaler", None)
        recovery = trainer_recovery(self, sharded=True)  # a healing group takes its shards' states too
        bind_shards(
            self._core, self.model, self.device_mesh, self.root_device, scaler, lambda: self.optimizers, recovery
        )

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """The global model through ``torch.distributed.checkpoint`` (Lightning's
        ``ModelParallelStrategy``), and each process's residuals and optimizer state in its own
        file beside it: each process's optimizer followed its own gradients, which the shared
        folder (one copy of each shard) cannot hold."""
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
    """What Lightning's ``ModelParallelStrategy.setup`` does once the model is sharded: materialize
    what was built on the meta device, precision, device, optimizers (fitting)."""
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
