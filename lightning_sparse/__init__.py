"""lightning_sparse: sparse gradient communication for PyTorch Lightning.

Importing the package registers ``sparse_ddp`` (and its variants) and ``sparse_fsdp`` with the Trainer and Fabric::

    import lightning_sparse
    trainer = Trainer(accelerator="cpu", devices=2, strategy="sparse_ddp")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="sparse_ddp")
"""

from lightning_sparse._utils import end_process_group
from lightning_sparse.compressors import (
    COMPRESSORS,
    DGC,
    ChunkTopK,
    Compressor,
    CountSketch,
    GaussianK,
    RandomBlock,
    RandomK,
    RTopK,
    TopK,
    register_compressor,
)
from lightning_sparse.config import SparseConfig
from lightning_sparse.exchange.fallback import TimedFallback
from lightning_sparse.exchange.hook import sparse_comm_hook
from lightning_sparse.exchange.outer import AddAverage, OuterStep
from lightning_sparse.exchange.state import ExchangeError, SparseState
from lightning_sparse.fabric.ddp import SparseDDPStrategy as FabricSparseDDPStrategy
from lightning_sparse.fabric.ddp import register_fabric_strategies
from lightning_sparse.fabric.fsdp import SparseFSDPStrategy as FabricSparseFSDPStrategy
from lightning_sparse.schedules import AdaptiveDensity, ConstantDensity, DensitySchedule, WarmupDensity
from lightning_sparse.strategies.ddp import SparseDDPStrategy, register_strategies
from lightning_sparse.strategies.fsdp import SparseFSDPStrategy, register_fsdp_strategy
from lightning_sparse.strategies.monitor import CompressionMonitor
from lightning_sparse.strategies.trainer_hooks import FlushResiduals
from lightning_sparse.telemetry.cost import exchange_collectives, exchange_cost, exchange_time

__version__ = "0.1.0"

register_strategies()
register_fsdp_strategy()
register_fabric_strategies()

__all__ = [
    "COMPRESSORS",
    "AdaptiveDensity",
    "AddAverage",
    "ChunkTopK",
    "CompressionMonitor",
    "Compressor",
    "ConstantDensity",
    "CountSketch",
    "DGC",
    "DensitySchedule",
    "ExchangeError",
    "FabricSparseDDPStrategy",
    "FabricSparseFSDPStrategy",
    "FlushResiduals",
    "GaussianK",
    "OuterStep",
    "RTopK",
    "RandomBlock",
    "RandomK",
    "SparseConfig",
    "SparseDDPStrategy",
    "SparseFSDPStrategy",
    "SparseState",
    "TimedFallback",
    "TopK",
    "WarmupDensity",
    "__version__",
    "end_process_group",
    "exchange_collectives",
    "exchange_cost",
    "exchange_time",
    "register_compressor",
    "register_fabric_strategies",
    "register_fsdp_strategy",
    "register_strategies",
    "sparse_comm_hook",
]
