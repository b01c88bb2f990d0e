"""SparseDDPStrategy for Lightning Fabric: ``Fabric(strategy="sparse_ddp")``, for a loop the user writes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse.exchange.replicas import Replicas
from lightning_sparse.fabric.fsdp import SparseFSDPStrategy
from lightning_sparse.fabric.hooks import FabricHooks, _Filter, _State
from lightning_sparse.strategies.checkpoint import CHECKPOINT_KEY
from lightning_sparse.strategies.settings import with_settings

__all__ = ["SparseDDPStrategy", "register_fabric_strategies"]


#: the arguments of Fabric's DDPStrategy the strategy takes and passes on
FABRIC_ARGS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision",
    "process_group_backend",
    "timeout",
)


@with_settings(extra="kwargs", inherit=(DDPStrategy, FABRIC_ARGS))
class SparseDDPStrategy(FabricHooks, DDPStrategy):
    """Fabric's DDP whose communication is a sparse exchange with error feedback.

    The Fabric counterpart of the Trainer's ``lightning_sparse.SparseDDPStrategy``; the compression figures are in
    ``fabric.strategy.sparse_state.telemetry``.

    Args:
        {settings}
        **kwargs: further arguments of ``DistributedDataParallel``.

    Example:
        >>> from lightning.fabric import Fabric
        >>> strategy = SparseDDPStrategy(compressor="gaussiank", density=0.001)
        >>> fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)  # doctest: +SKIP
    """

    def __init__(self, **settings: Any) -> None:
        fabric_args = self._take_settings(SparseDDPStrategy, settings)
        super().__init__(**fabric_args, start_method=self._core.config.start_method, **self._core.ddp_kwargs)
        self._optimizers: list[Optimizer] = []
        self._backward_sync_control = _BackwardSyncOf()

    def setup_module(self, module: Module) -> Module:  # type: ignore[override]  # Replicas too
        """Make the module data parallel and bind the sparse communication to it (any device)."""
        model = self._core.wrap(module, self._determine_ddp_device_ids(), self._ddp_kwargs)
        self._bind(model)
        self._watch_forward(model)
        self._module = module
        return model

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return super().get_module_state_dict(module.module if isinstance(module, Replicas) else module)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        module = module.module if isinstance(module, Replicas) else module
        super().load_module_state_dict(module, state_dict, strict=strict)

    def _save_with_sparse(self, path: _PATH, state: _State, storage_options: Any, filter: _Filter) -> None:
        self._core.global_model()  # every rank saves together
        converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
        optimizers = [k for k, obj in state.items() if isinstance(obj, Optimizer) and k in converted]
        optimizer_states = {k: converted[k] for k in optimizers}
        entry = self._save_sparse(path, optimizer_states or None, storage_options)
        if self.is_global_zero:
            converted[CHECKPOINT_KEY] = entry
            self.checkpoint_io.save_checkpoint(checkpoint=converted, path=path, storage_options=storage_options)

    def _load_with_sparse(self, path: _PATH, state: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        io = self.checkpoint_io
        self.checkpoint_io = _RestoringIO(io, self._restore)
        try:
            return DDPStrategy.load_checkpoint(self, path, state=state, strict=strict, weights_only=weights_only)
        finally:
            self.checkpoint_io = io

    def _restore(self, checkpoint: Any, path: _PATH, weights_only: bool | None) -> Any:
        """Take the sparse state out of a loaded checkpoint; this rank's own optimizer states into it."""
        if isinstance(checkpoint, dict) and CHECKPOINT_KEY in checkpoint:
            self._restore_sparse(checkpoint, path, self._module is not None, weights_only)
        return checkpoint


def register_fabric_strategies() -> None:
    """Make ``Fabric(strategy="sparse_ddp")``, its variants and ``"sparse_fsdp"`` resolve (idempotent)."""
    SparseDDPStrategy.register_strategies(STRATEGY_REGISTRY)
    SparseFSDPStrategy.register_strategies(STRATEGY_REGISTRY)


class _BackwardSyncOf(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: DDP's ``no_sync``; nothing for update mode's ``Replicas``, whose backward
    syncs nothing."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        if enabled and not isinstance(module, Replicas):
            raise TypeError(f"no_backward_sync expected the module set up by the strategy, got {type(module).__name__}")
        return nullcontext()


class _RestoringIO(CheckpointIO):
    """A CheckpointIO that passes what ``io`` loads through ``restore`` (saving is ``io``'s)."""

    def __init__(self, io: CheckpointIO, restore: Callable[[Any, _PATH, bool | None], Any]) -> None:
        self.io = io
        self.restore = restore

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        self.io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        checkpoint = self.io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return self.restore(checkpoint, path, weights_only)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        self.io.remove_checkpoint(path)
