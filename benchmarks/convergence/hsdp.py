"""Dense HSDP, the sharded baseline: FSDP2 on the 2-D mesh (replicate, shard), gradients all-reduced across groups."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy

from lightning_sparse.strategies.fsdp import finish_sharded_setup
from lightning_sparse.strategies.sharding import reshard, sharding_units


class DenseHSDPStrategy(ModelParallelStrategy):
    """FSDP2's hybrid sharding: the modules of the classes named in ``sharded_modules``, then the
    LightningModule, are sharded with ``fully_shard`` on a 2-D mesh of groups of ``shard_size``
    processes: reduce-scatter inside a group, a dense all-reduce of each shard's gradient across the
    groups, what ``sparse_fsdp`` compresses. Every process trains on its own batches.

    Example:
        >>> DenseHSDPStrategy(2, ["_Block"]).shard_size
        2
    """

    def __init__(self, shard_size: int, sharded_modules: list[str]) -> None:
        super().__init__()
        self.shard_size = shard_size
        self.sharded_modules = list(sharded_modules)

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        shape = (self.world_size // self.shard_size, self.shard_size)
        self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=("replicate", "shard"))
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            for unit in sharding_units(self.model, self.sharded_modules):  # as sparse_fsdp shards it
                fully_shard(unit, mesh=self.device_mesh)
        finish_sharded_setup(self, trainer)

    def _root_step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # as sparse_fsdp: every step inside the root unit's forward (a step may call self.model(...))
        from torch.distributed.fsdp import FSDPModule

        module = self.lightning_module
        assert module is not None
        if isinstance(self.model, FSDPModule) and self.model is module:
            return self._forward_redirection(module, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._root_step("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._root_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._root_step("test_step", *args, **kwargs)

    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.model is not None:
            reshard(self.model)
