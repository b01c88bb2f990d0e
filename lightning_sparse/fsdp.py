"""SparseFSDPStrategy: FSDP2 inside each group of processes, the sparse exchange across groups (sparse HSDP)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse._utils import check_bool, end_process_group_at_exit
from lightning_sparse.checkpoint import CHECKPOINT_KEY
from lightning_sparse.compressors import Compressor
from lightning_sparse.config import SparseConfig, setting_docs
from lightning_sparse.core import SparseCore
from lightning_sparse.fallback import TimedFallback
from lightning_sparse.outer import OuterStep
from lightning_sparse.schedules import DensitySchedule
from lightning_sparse.stats import Telemetry
from lightning_sparse.trainer_hooks import TrainerHooks

__all__ = [
    "FSDP_SETTINGS",
    "SparseFSDPStrategy",
    "bind_shards",
    "check_mesh",
    "check_sharding_arguments",
    "count_group_traffic",
    "finish_sharded_setup",
    "load_local_optimizer_states",
    "local_tree",
    "make_mesh",
    "mesh_shape",
    "register_fsdp_strategy",
    "settings_doc",
    "shard_module",
]

#: the settings of the exchange this strategy takes (DDP's own arguments do not apply)
FSDP_SETTINGS = (
    "compress",
    "compressor",
    "density",
    "error_feedback",
    "min_numel",
    "warmup_steps",
    "value_dtype",
    "seed",
    "fallback_to_dense",
    "momentum_correction",
    "exchange",
    "compact_indices",
    "sync_every",
    "outer_optimizer",
    "value_bits",
    "batchnorm_batches",
    "sync_delay",
    "fragments",
    "fragment_split",
    "offload_global",
    "bucket_cap_mb",
)
MESH_DIMS = ("replicate", "shard")


def settings_doc() -> str:
    docs = setting_docs()
    lines = []
    for name in FSDP_SETTINGS:
        text = docs[name]
        if name == "bucket_cap_mb":
            text = "size of the exchange's messages in MB (None: 25)."
        lines.append(textwrap.fill(f"{name}: {text}", 112, initial_indent="    ", subsequent_indent="        "))
    return "\n".join(lines)


class SparseFSDPStrategy(TrainerHooks, ModelParallelStrategy):
    __doc__ = """FSDP2 inside each group of ``shard_size`` processes, update mode's sparse exchange across groups.

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
    ``sharded_modules``, then the LightningModule itself, which holds the rest (FSDP2 gathers it in the
    module's ``forward``: the ``training_step`` calls ``self(...)``).
    Checkpoints are folders of ``torch.distributed.checkpoint`` (the global model, written once, each
    shard by one process) with each process's residuals and optimizer state in a file of its own
    beside them (``<path>.sparse/``); ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
    turns the folder into one ``torch.save`` file for inference. Resuming needs the same number of
    processes and ``shard_size``.

    Args:
        shard_size: processes per group (FSDP2 inside, the exchange across); None (default): the
            processes of one node. Must divide the number of processes.
        sharded_modules: names of module classes to shard (e.g. ``["TransformerBlock"]``), for a
            LightningModule without a ``configure_model`` that shards it; None: ``configure_model`` does.
{settings}
        compression_monitor: add a ``lightning_sparse.CompressionMonitor`` to the Trainer's callbacks when
            fitting, unless it already has one. ``False`` adds nothing.
        process_group_backend: as in Lightning's ``ModelParallelStrategy``.
        timeout: as in Lightning's ``ModelParallelStrategy``.

    Example:
        >>> import lightning_sparse
        >>> from lightning.pytorch import Trainer
        >>> strategy = SparseFSDPStrategy(shard_size=2, sharded_modules=["Block"], sync_every=4, value_bits=2)
        >>> trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy)  # doctest: +SKIP
    """.format(settings=textwrap.indent(settings_doc(), "    "))

    strategy_name = "sparse_fsdp"

    def __init__(
        self,
        shard_size: int | None = None,
        sharded_modules: list[str] | None = None,
        compress: Literal["update", "gradient"] = "update",
        compressor: str | Compressor = "topk",
        density: float | DensitySchedule = 0.01,
        error_feedback: bool = True,
        min_numel: int = 1024,
        warmup_steps: int = 1,
        value_dtype: Literal["float32", "float16", "bfloat16"] | torch.dtype | None = None,
        seed: int = 0,
        fallback_to_dense: bool | Literal["bytes", "time"] | TimedFallback = True,
        momentum_correction: float = 0.0,
        exchange: Literal["auto", "allgather", "split"] = "auto",
        compact_indices: bool = True,
        sync_every: int = 1,
        outer_optimizer: Literal["nesterov"] | Callable[[Iterable[Any]], Optimizer] | OuterStep | None = None,
        value_bits: Literal[2, 4, 8] | None = None,
        batchnorm_batches: int = 16,
        sync_delay: int = 0,
        fragments: int = 1,
        fragment_split: Literal["strided", "contiguous"] = "strided",
        offload_global: bool = False,
        bucket_cap_mb: float | None = None,
        compression_monitor: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_bool("compression_monitor", compression_monitor)
        check_sharding_arguments(compress, fallback_to_dense, momentum_correction, shard_size, sharded_modules)
        self._core = SparseCore(SparseConfig.of(locals()))
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
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
        created = not _distributed_is_initialized()
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        end_process_group_at_exit(created=created)
        self._device_mesh = make_mesh(self.root_device, self.world_size, self._shard_size or self.num_processes)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every process trains on its own batches (inside a group FSDP2 averages their gradients)
        return {"num_replicas": self.world_size, "rank": self.global_rank}

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

    def _bind(self) -> None:
        assert self.model is not None
        scaler = getattr(self.precision_plugin, "scaler", None)
        bind_shards(self._core, self.model, self.device_mesh, self.root_device, scaler, lambda: self.optimizers)

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

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``sparse_fsdp`` (idempotent)."""
        if "sparse_fsdp" not in strategy_registry or strategy_registry["sparse_fsdp"].get("strategy") is not cls:
            strategy_registry.register(
                "sparse_fsdp", cls, description="FSDP2 inside groups, sparse exchange across", override=True
            )


# ---------------------------------------------------------------------- shared by both front ends
def check_sharding_arguments(
    compress: Any, fallback_to_dense: Any, momentum_correction: Any, shard_size: Any, sharded_modules: Any
) -> None:
    """The arguments both front ends of ``sparse_fsdp`` refuse at construction (ValueError)."""
    if compress != "update":
        raise ValueError(
            f"compress={compress!r} is not allowed with SparseFSDPStrategy: expected 'update' (each process "
            "steps on its shards, then the exchange runs across groups); gradient mode needs DDP's hook"
        )
    if fallback_to_dense == "time" or isinstance(fallback_to_dense, TimedFallback):
        raise ValueError(
            f"fallback_to_dense={fallback_to_dense!r} is not allowed with SparseFSDPStrategy: expected True, "
            "'bytes' or False (a timed fallback switches to DDP's plain steps)"
        )
    if momentum_correction:
        raise ValueError(
            f"momentum_correction={momentum_correction!r} is not allowed with SparseFSDPStrategy: expected 0 "
            "(it is a gradient-mode setting)"
        )
    if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1):
        raise ValueError(f"shard_size={shard_size!r} is not allowed: expected an int >= 1 or None")
    if sharded_modules is not None and (
        isinstance(sharded_modules, str)
        or not all(isinstance(m, str) and m for m in sharded_modules)
        or not sharded_modules
    ):
        raise ValueError(
            f"sharded_modules={sharded_modules!r} is not allowed: expected a non-empty list of module class "
            "names, or None"
        )


def make_mesh(device: torch.device, world_size: int, shard_size: int) -> Any:
    """The ``("replicate", "shard")`` mesh of ``world_size / shard_size`` groups of ``shard_size``."""
    from torch.distributed.device_mesh import init_device_mesh

    if world_size % shard_size:
        raise ValueError(
            f"shard_size={shard_size} is not allowed with {world_size} processes: expected a divisor of the "
            "number of processes"
        )
    return init_device_mesh(device.type, (world_size // shard_size, shard_size), mesh_dim_names=MESH_DIMS)


def mesh_shape(mesh: Any) -> list[int]:
    """[groups, shard_size] of a mesh: what a checkpoint records and a resume must match."""
    return [int(mesh[d].size()) for d in MESH_DIMS]


def check_mesh(entry: Mapping[str, Any] | None, shape: list[int], path: _PATH) -> None:
    """Refuse a checkpoint not written by ``sparse_fsdp``, or on another mesh (ValueError)."""
    if entry is None:
        raise ValueError(f"{str(path)!r} holds no lightning_sparse state: it was not written by SparseFSDPStrategy")
    if entry.get("mesh") != shape:
        raise ValueError(
            f"the checkpoint {str(path)!r} was written on a mesh of {entry.get('mesh')} (groups, shard_size) and "
            f"is resumed on {shape}: SparseFSDPStrategy resumes on the same number of processes and shard_size"
        )


def shard_module(module: torch.nn.Module, mesh: Any, sharded_modules: list[str] | None, ours: bool) -> bool:
    """Shard ``module`` on the ``"shard"`` mesh: every module whose class is named in ``sharded_modules``,
    then ``module`` itself; or check that the caller sharded it (``sharded_modules`` None). ``ours``:
    this strategy sharded ``module`` in an earlier run. Returns whether it was sharded here."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    sharded = any(isinstance(m, FSDPModule) for m in module.modules())
    if sharded and ours:
        return False  # sharded by this strategy in an earlier run (fit, then validate)
    if sharded and sharded_modules:
        raise ValueError(
            f"sharded_modules={sharded_modules!r} is not allowed for a module that is sharded already (by "
            "configure_model or a parallelize_fn): expected None"
        )
    if sharded:
        return False
    if not sharded_modules:
        raise TypeError(
            "SparseFSDPStrategy found no module sharded with fully_shard: shard the model yourself "
            "(fully_shard(module, mesh=device_mesh['shard']) in the LightningModule's configure_model, or in a "
            "parallelize_fn with Fabric), or name the module classes to shard in "
            "SparseFSDPStrategy(sharded_modules=[...])"
        )
    names = set(sharded_modules)
    found = {type(m).__name__ for m in module.modules()}
    if not names & found:
        raise ValueError(
            f"sharded_modules={sharded_modules!r} names no module of the model: its module classes are {sorted(found)}"
        )
    for m in list(module.modules()):
        if type(m).__name__ in names and not isinstance(m, FSDPModule):
            fully_shard(m, mesh=mesh)
    # then the module itself: the rest (embeddings, final norms, a tied output layer), gathered in its forward
    fully_shard(module, mesh=mesh)
    return True


def count_group_traffic(module: torch.nn.Module, telemetry: Telemetry) -> bool:
    """Count the bytes of every all-gather and reduce-scatter FSDP2 issues for ``module`` inside the
    group into ``telemetry.group_bytes`` (ring model: ``(S - 1) / S`` of the gathered or scattered
    tensor through each of the group's ``S`` processes). Each of its collectives is wrapped, not
    changed. Returns False where this torch has no FSDP2 collectives to wrap."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:
        return False

    class _CountedAllGather(AllGather):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
            size = dist.get_world_size(group)
            telemetry.record_group((size - 1) / size * output_tensor.numel() * output_tensor.element_size())
            return self.inner(output_tensor, input_tensor, group, async_op)

    class _CountedReduceScatter(ReduceScatter):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> Any:
            size = dist.get_world_size(group)
            telemetry.record_group((size - 1) / size * input_tensor.numel() * input_tensor.element_size())
            return self.inner(output_tensor, input_tensor, group, op, async_op)

    counted = False
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before per-parameter meshes: one group or none
            one = getattr(state, "_fsdp_param_group", None)
            groups = [] if one is None else [one]
        for g in groups:
            gather, scatter = getattr(g, "_all_gather_comm", None), getattr(g, "_reduce_scatter_comm", None)
            if gather is None or scatter is None:
                continue
            if not isinstance(gather, _CountedAllGather):
                g._all_gather_comm = _CountedAllGather(getattr(gather, "inner", gather))
            if not isinstance(scatter, _CountedReduceScatter):
                g._reduce_scatter_comm = _CountedReduceScatter(getattr(scatter, "inner", scatter))
            counted = True
    if counted and telemetry.group_bytes is None:
        telemetry.group_bytes = 0.0
    return counted


def bind_shards(
    core: SparseCore,
    module: torch.nn.Module,
    mesh: Any,
    device: torch.device,
    scaler: Any,
    optimizers: Callable[[], list[Any]],
) -> None:
    """Bind the exchange to this process's shards of ``module``'s parameters, across the ``"replicate"``
    dimension."""
    named = [(n, p) for n, p in module.named_parameters()]
    # the exchange works on this process's shards: to_local().detach() shares the DTensor's
    # storage (what it writes is what FSDP2 all-gathers at the next forward) and is outside
    # autograd; the DTensors, which the optimizer holds, stand for them
    local = [(n, p.to_local().detach() if hasattr(p, "to_local") else p) for n, p in named]
    count_group_traffic(module, core.state.telemetry)
    replicate = mesh["replicate"]
    core.bind(
        local,
        replicate.get_group(),
        int(replicate.get_local_rank()),
        int(replicate.size()),
        device,
        scaler,
        optimizers=optimizers,
        module=module,
        aliases=named,
    )


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


def load_local_optimizer_states(module: torch.nn.Module, pairs: list[tuple[Optimizer, dict[str, Any]]]) -> None:
    """Give each optimizer the state this process saved (:func:`local_tree` of
    ``get_optimizer_state_dict``), its tensors made DTensors again like their parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    params = dict(module.named_parameters())
    for optimizer, state in pairs:
        tree = _sharded_tree(state, params)
        set_optimizer_state_dict(module, optimizer, tree, options=StateDictOptions(full_state_dict=False))


def local_tree(state: Any) -> Any:
    """An optimizer's ``state_dict()`` with every DTensor replaced by this process's local tensor."""
    if hasattr(state, "to_local") and hasattr(state, "placements"):
        return state.to_local()
    if isinstance(state, dict):
        return {k: local_tree(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        items = [local_tree(v) for v in state]
        return type(state)(items) if isinstance(state, tuple) else items
    return state


def _sharded_tree(state: dict[str, Any], params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What :func:`_local_tree` wrote of ``get_optimizer_state_dict``'s state (keyed by parameter
    name), its tensors of a parameter's local shape made DTensors again like that parameter."""
    from torch.distributed.tensor import DTensor

    restored: dict[str, Any] = {}
    for name, slot in state["state"].items():
        p = params[name]
        if not isinstance(p, DTensor):
            restored[name] = slot
            continue
        local_shape = p.to_local().shape
        restored[name] = {
            k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(v, torch.Tensor) and v.shape == local_shape and v.dim() > 0
            else v
            for k, v in slot.items()
        }
    return {**state, "state": restored}
