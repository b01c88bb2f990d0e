"""The Lightning Fabric strategies: ``Fabric(strategy="sparse_ddp")`` and ``Fabric(strategy="sparse_fsdp")``.

- :mod:`~lightning_sparse.fabric.ddp` - ``SparseDDPStrategy`` and the registered names (the loop it serves);
- :mod:`~lightning_sparse.fabric.fsdp` - ``SparseFSDPStrategy`` (FSDP2 in groups);
- :mod:`~lightning_sparse.fabric.hooks` - the Fabric strategies' shared hooks.
"""

from lightning_sparse.fabric.ddp import SparseDDPStrategy, register_fabric_strategies
from lightning_sparse.fabric.fsdp import SparseFSDPStrategy

__all__ = ["SparseDDPStrategy", "SparseFSDPStrategy", "register_fabric_strategies"]
