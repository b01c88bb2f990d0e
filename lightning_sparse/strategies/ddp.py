"""SparseDDPStrategy: Lightning's DDP with sparse gradient communication."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_sparse._utils import check_bool
from lightning_sparse.exchange.replicas import Replicas
from lightning_sparse.strategies.advice import training_advice
from lightning_sparse.strategies.checkpoint import CHECKPOINT_KEY
from lightning_sparse.strategies.settings import with_settings
from lightning_sparse.strategies.trainer_hooks import TrainerHooks

__all__ = ["CHECKPOINT_KEY", "SparseDDPStrategy", "register_strategies", "training_advice"]


#: the arguments of Lightning's DDPStrategy the strategy takes and passes on
LIGHTNING_ARGS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "timeout",
)


@with_settings(extra="kwargs", inherit=(DDPStrategy, LIGHTNING_ARGS))
class SparseDDPStrategy(TrainerHooks, DDPStrategy):
    """Lightning's DDP with a sparse exchange with error feedback in place of the gradient all-reduce.

    ``compress="update"`` (default): each rank steps on its own gradient, then part of its progress is exchanged
    (no ``DistributedDataParallel``, :class:`~lightning_sparse.exchange.replicas.Replicas` instead).
    ``compress="gradient"``: DDP's communication hook sends part of each gradient plus residual.

    Args:
        {settings}
        compression_monitor: add a ``lightning_sparse.CompressionMonitor`` when fitting, unless there is one.
        **kwargs: further arguments of ``DistributedDataParallel``.

    Example:
        >>> import lightning_sparse
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy="sparse_ddp")  # doctest: +SKIP
        >>> strategy = SparseDDPStrategy(compressor="randomk", density=0.001)
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)  # doctest: +SKIP
    """

    def __init__(self, *, compression_monitor: bool = True, **settings: Any) -> None:
        check_bool("compression_monitor", compression_monitor)
        lightning_args = self._take_settings(SparseDDPStrategy, settings)
        super().__init__(**lightning_args, start_method=self._core.config.start_method, **self._core.ddp_kwargs)
        self.compression_monitor = compression_monitor

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._core.check_optimizers(self.optimizers, self.world_size, self.lightning_module)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:  # type: ignore[override]  # Replicas too
        return self._core.wrap(model, self.determine_ddp_device_ids(), self._ddp_kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        self._bind(self.model)  # on every device (Lightning's DDPStrategy registers comm hooks only on CUDA)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # on every process: each writes its own sparse state, no gather
        states = {"optimizer_states": checkpoint["optimizer_states"]} if "optimizer_states" in checkpoint else None
        checkpoint[CHECKPOINT_KEY] = self._save_sparse(filepath, states, storage_options)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if CHECKPOINT_KEY in checkpoint:
            # applied now or when the hook is registered; update mode: the optimizer states become this process's
            now = isinstance(self.model, (DistributedDataParallel, Replicas))
            self._restore_sparse(checkpoint, checkpoint_path, now, weights_only)
        return checkpoint

    @override
    def teardown(self) -> None:
        if isinstance(self.model, Replicas):  # unwrapped as Lightning unwraps DDP
            self.model = self.lightning_module
        super().teardown()


def register_strategies() -> None:
    """Make ``Trainer(strategy="sparse_ddp")`` and its variants resolve (idempotent)."""
    SparseDDPStrategy.register_strategies(StrategyRegistry)
