"""The Lightning Fabric strategies: ``Fabric(strategy="sparse_ddp")`` and ``Fabric(strategy="sparse_fsdp")``."""

from lightning_sparse.fabric.ddp import SparseDDPStrategy, register_fabric_strategies
from lightning_sparse.fabric.fsdp import SparseFSDPStrategy

__all__ = ["SparseDDPStrategy", "SparseFSDPStrategy", "register_fabric_strategies"]
