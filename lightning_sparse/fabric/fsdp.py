"""SparseFSDPStrategy for Lightning Fabric: ``Fabric(strategy="sparse_fsdp")``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse.fabric.hooks import FabricHooks, _Filter, _State
from lightning_sparse.strategies.checkpoint import CHECKPOINT_KEY
from lightning_sparse.strategies.sharding import (
    ShardedFront,
    load_local_optimizer_states,
    local_tree,
    reshard,
    shard_module,
    with_fsdp_settings,
)

__all__ = ["SparseFSDPStrategy"]


@with_fsdp_settings(ModelParallelStrategy)
class SparseFSDPStrategy(ShardedFront, FabricHooks, ModelParallelStrategy):
    """Fabric's sparse HSDP: FSDP2 inside each group of ``shard_size`` processes, the sparse exchange across.

    The Fabric counterpart of the Trainer's ``lightning_sparse.SparseFSDPStrategy``, the module sharded by
    ``parallelize_fn(module, device_mesh)`` or by the strategy (``sharded_modules``), which replaces its parameters:
    ``fabric.setup_module(model)`` first, then make the optimizer. ``fabric.load`` with the keys ``fabric.save`` had
    resumes exactly, on the same processes and ``shard_size``.

    Args:
        shard_size: processes per group; None (default): the processes of one node.
        sharded_modules: names of module classes to shard; None: ``parallelize_fn`` shards.
        parallelize_fn: ``fn(module, device_mesh) -> module`` that shards the module itself, or None.
        {settings}

    Example:
        >>> from lightning.fabric import Fabric
        >>> strategy = SparseFSDPStrategy(shard_size=2, sharded_modules=["Block"], sync_every=4)
        >>> fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)  # doctest: +SKIP
    """

    def __init__(
        self,
        shard_size: int | None = None,
        sharded_modules: list[str] | None = None,
        parallelize_fn: Callable[[Module, Any], Module] | None = None,
        **settings: Any,
    ) -> None:
        self._take_sharding(settings, shard_size, sharded_modules)
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise ValueError(f"parallelize_fn={parallelize_fn!r} is not allowed: expected a callable or None")
        if parallelize_fn is not None and sharded_modules is not None:
            raise ValueError(
                f"sharded_modules={sharded_modules!r} is not allowed with a parallelize_fn: expected None (the "
                "parallelize_fn shards the module)"
            )
        super().__init__(parallelize_fn=self._parallelize, **self._take_settings(SparseFSDPStrategy, settings))
        self._user_parallelize = parallelize_fn
        self._io = TorchCheckpointIO()  # for the processes' own files (the folder is DCP's)
        self._optimizers: list[Optimizer] = []

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The writer of the processes' own files (the global model goes through DCP)."""
        return self._io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support setting a `CheckpointIO` plugin.")

    @override
    def setup_environment(self) -> None:
        self._start_mesh(lambda: ParallelStrategy.setup_environment(self))

    def _parallelize(self, module: Module, mesh: Any) -> Module:
        if self._user_parallelize is not None:
            module = self._user_parallelize(module, mesh)
        shard_module(module, mesh["shard"], self.sharded_modules, ours=False)
        return module

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        raise RuntimeError(
            "SparseFSDPStrategy shards the module, which replaces its parameters: set the module up first "
            "(model = fabric.setup_module(model)), then make the optimizer from model.parameters() and set it "
            "up (optimizer = fabric.setup_optimizers(optimizer))"
        )

    @override
    def setup_module(self, module: Module) -> Module:
        """Shard the module, materialize it, and bind the exchange to this process's shards."""
        module = super().setup_module(module)  # parallelize, then materialize what is on the meta device
        self._bind(module)
        self._watch_forward(module)
        self._module = module
        return module

    @override
    def _watch_forward(self, module: Module) -> None:
        """Watch the forward of every FSDP2 unit, not only the module's: a loop may call a submodule
        (``model.model(input_ids=x, labels=x)``)."""
        from torch.distributed.fsdp import FSDPModule

        units: list[Module] = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for unit in units or [module]:
            super()._watch_forward(unit)
            unit.register_forward_hook(self._after_forward)

    @staticmethod
    def _after_forward(module: Module, args: Any, output: Any) -> None:
        # an evaluation forward leaves the parameters gathered (see sharding.reshard)
        if not (module.training and torch.is_grad_enabled()):
            reshard(module)

    def _save_with_sparse(self, path: _PATH, state: _State, storage_options: Any, filter: _Filter) -> None:
        # the optimizer states go to each process's own file: DCP's folder keeps one copy of each shard
        if storage_options is not None:
            raise TypeError(
                f"storage_options={storage_options!r} is not allowed with SparseFSDPStrategy: expected None"
            )
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        self._core.global_model()  # every process saves together
        module, optimizers, rest = self._split(state)
        local = {k: local_tree(get_optimizer_state_dict(module, opt)) for k, opt in optimizers.items()}
        path = Path(self.broadcast(path))
        entry = self._save_sparse(path, local or None, None)
        ModelParallelStrategy.save_checkpoint(self, path, {**rest, CHECKPOINT_KEY: entry}, filter=filter)

    def _load_with_sparse(self, path: _PATH, state: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:  # a module alone: the global model only
            return ModelParallelStrategy.load_checkpoint(self, path, state, strict, weights_only)
        path = Path(self.broadcast(path))
        module, optimizers, rest = self._split(state)
        metadata = _load_checkpoint(path=path, state=rest, strict=strict, weights_only=weights_only)
        state.update(rest)  # the metadata the caller asked for, loaded into ``rest``
        self._restore_shards(metadata, path, weights_only)
        missing = [k for k in optimizers if k not in metadata]
        if missing and strict:
            raise KeyError(f"the checkpoint {str(path)!r} holds no optimizer state for {missing}")
        load_local_optimizer_states(module, [(opt, metadata.pop(k)) for k, opt in optimizers.items() if k in metadata])
        return metadata

    @staticmethod
    def _split(state: dict[str, Any]) -> tuple[Module, dict[str, Optimizer], dict[str, Any]]:
        """The sharded module of a checkpoint's ``state`` (a Fabric-wrapped one's inner), its optimizers, the rest."""
        modules = [v for v in state.values() if isinstance(v, Module)]
        if len(modules) != 1:
            raise ValueError(
                f"a checkpoint's state with {len(modules)} modules is not allowed with SparseFSDPStrategy: expected "
                "one (the sharded model)"
            )
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        rest = {k: v for k, v in state.items() if k not in optimizers}
        return getattr(modules[0], "_forward_module", modules[0]), optimizers, rest
