"""Dense HSDP, the sharded baseline: FSDP2 on the 2-D mesh (replicate, shard), gradients all-reduced across groups."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy

from lightning_sparse.fsdp import finish_sharded_setup


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
            for m in list(self.model.modules()):
                if type(m).__name__ in self.sharded_modules:
                    fully_shard(m, mesh=self.device_mesh)
            fully_shard(self.model, mesh=self.device_mesh)
        finish_sharded_setup(self, trainer)
