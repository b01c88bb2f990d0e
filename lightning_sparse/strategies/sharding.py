"""What both front ends of ``sparse_fsdp`` share: settings, mesh, sharding, binding, traffic, optimizer states."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from torch.optim import Optimizer

from lightning_sparse._utils import TORCH_FOR_FSDP2, TORCH_FOR_FSDP2_FT, torch_at_least
from lightning_sparse.config import SparseConfig, setting_names
from lightning_sparse.exchange.fallback import TimedFallback
from lightning_sparse.strategies.checkpoint import CHECKPOINT_KEY, map_leaves
from lightning_sparse.strategies.core import FSDP_NAMES
from lightning_sparse.strategies.settings import DDP_ONLY, T, with_settings
from lightning_sparse.strategies.shell import SparseShell
from lightning_sparse.wire.stats import Telemetry

__all__ = [
    "FSDP_SETTINGS",
    "ShardedFront",
    "count_group_traffic",
    "load_local_optimizer_state",
    "load_local_optimizer_states",
    "local_tree",
    "reshard",
    "shard_module",
    "sharding_units",
    "with_fsdp_settings",
]

#: the settings of the exchange this strategy takes (DDP's own arguments do not apply)
FSDP_SETTINGS = tuple(name for name in setting_names() if name not in DDP_ONLY)
MESH_DIMS = ("replicate", "shard")


def with_fsdp_settings(base: type) -> Callable[[T], T]:
    """:func:`~lightning_sparse.strategies.settings.with_settings` for a ``sparse_fsdp`` front end of ``base``."""
    return with_settings(
        exclude=DDP_ONLY,
        docs={"bucket_cap_mb": "size of the exchange's messages in MB (None: 25)."},
        inherit=(base, ("process_group_backend", "timeout")),
    )


class ShardedFront(SparseShell):
    """What both ``sparse_fsdp`` front ends share: their name, sharding arguments, mesh, binding and checkpoints."""

    strategy_name = "sparse_fsdp"
    _names = FSDP_NAMES
    device_mesh: Any  # the Lightning strategy's
    _device_mesh: Any
    num_processes: int

    def _take_sharding(self, settings: dict[str, Any], shard_size: Any, sharded_modules: Any) -> None:
        """Refuse (ValueError) bad sharding arguments and, among the ``settings``, those of gradient mode; keep them.
        A torch before 2.7 is refused (RuntimeError): FSDP2 is public from 2.6, and runs on CPUs from 2.7; with
        ``fault_tolerant=True``, before 2.10, whose streaming load of a healing group's state refuses an empty shard."""
        fields = SparseConfig.__dataclass_fields__
        compress, fallback_to_dense, momentum_correction, fault_tolerant = (
            settings.get(n, fields[n].default)
            for n in ("compress", "fallback_to_dense", "momentum_correction", "fault_tolerant")
        )
        if not torch_at_least(TORCH_FOR_FSDP2_FT if fault_tolerant is True else TORCH_FOR_FSDP2):
            raise RuntimeError(
                f"{type(self).__name__} needs torch >= {TORCH_FOR_FSDP2} (FSDP2's torch.distributed.fsdp.fully_shard, "
                f"on CPUs and GPUs), and >= {TORCH_FOR_FSDP2_FT} with fault_tolerant=True (a healing group loads "
                f"shards that may be empty); this is torch {torch.__version__}. Upgrade torch, or use "
                "SparseDDPStrategy."
            )
        rules = (
            (fault_tolerant is True and shard_size is not None,
             f"shard_size={shard_size!r} is not allowed with fault_tolerant=True: expected None (a replica group is "
             "one job, sharded across all its processes; the exchange runs across the jobs)"),
            (compress != "update",
             f"compress={compress!r} is not allowed with SparseFSDPStrategy: expected 'update' (each process steps on "
             "its shards, then the exchange runs across groups); gradient mode needs DDP's hook"),
            (fallback_to_dense == "time" or isinstance(fallback_to_dense, TimedFallback),
             f"fallback_to_dense={fallback_to_dense!r} is not allowed with SparseFSDPStrategy: expected True, 'bytes' "
             "or False (a timed fallback switches to DDP's plain steps)"),
            (momentum_correction,
             f"momentum_correction={momentum_correction!r} is not allowed with SparseFSDPStrategy: expected 0 (it is "
             "a gradient-mode setting)"),
            (shard_size is not None
             and (isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1),
             f"shard_size={shard_size!r} is not allowed: expected an int >= 1 or None"),
        )  # fmt: skip
        for broken, message in rules:
            if broken:
                raise ValueError(message)
        if sharded_modules is not None and (
            isinstance(sharded_modules, str)
            or not all(isinstance(m, str) and m for m in sharded_modules)
            or not sharded_modules
        ):
            raise ValueError(
                f"sharded_modules={sharded_modules!r} is not allowed: expected a non-empty list of module class "
                "names, or None"
            )
        self._shard_size: int | None = shard_size
        self.sharded_modules: list[str] | None = None if sharded_modules is None else list(sharded_modules)

    @property
    def shard_size(self) -> int:
        """Processes per group (the mesh's ``"shard"`` dimension)."""
        return int(self.device_mesh["shard"].size())

    @property
    def _exchange_size(self) -> int:
        return int(self.device_mesh["replicate"].size())

    def _start_mesh(self, setup: Callable[[], None]) -> None:
        """``setup_environment``: ``setup`` (``ParallelStrategy``'s, which builds no mesh) and the process group,
        then the ``("replicate", "shard")`` mesh: groups of ``shard_size`` processes (None: those of one node;
        fault-tolerant: all the job's)."""

        def start() -> None:
            setup()
            self._setup_distributed()  # type: ignore[attr-defined]

        self._start_processes(start)
        world_size = self.world_size
        shard_size = world_size if self._core.config.fault_tolerant else self._shard_size or self.num_processes
        from torch.distributed.device_mesh import init_device_mesh

        if world_size % shard_size:
            raise ValueError(
                f"shard_size={shard_size} is not allowed with {world_size} processes: expected a divisor of the "
                "number of processes"
            )
        self._device_mesh = init_device_mesh(
            self.root_device.type, (world_size // shard_size, shard_size), mesh_dim_names=MESH_DIMS
        )

    def _bind(self, module: Any) -> None:
        """Bind the exchange to this process's shards of ``module``'s parameters, across ``"replicate"``."""
        named = [(n, p) for n, p in module.named_parameters()]
        # to_local().detach() shares the DTensor's storage (what the exchange writes, FSDP2 gathers next) outside
        # autograd; the DTensors, which the optimizer holds, are the aliases
        local = [(n, p.to_local().detach() if hasattr(p, "to_local") else p) for n, p in named]
        core = self._core
        count_group_traffic(module, core.state.telemetry)
        replicate, shard = self.device_mesh["replicate"], self.device_mesh["shard"]
        group, rank, size = replicate.get_group(), int(replicate.get_local_rank()), int(replicate.size())
        job = (shard.get_group(), int(shard.get_local_rank()), int(shard.size()))
        scaler, optimizers, recovery = self._binding(sharded=True)
        core.bind(local, group, rank, size, self.root_device, scaler, optimizers, module, named, job, recovery)

    def _save_sparse(
        self, path: _PATH, optimizer_states: dict[str, Any] | None, storage_options: Any
    ) -> dict[str, Any]:
        """Write this process's file (with its optimizer states: DCP's folder keeps one copy of each shard) beside
        the checkpoint at ``path``; the checkpoint's entry, with the mesh."""
        entry = self._core.checkpoint.save(
            path, self.global_rank, self.world_size, optimizer_states, self.checkpoint_io, storage_options, False
        )
        entry["mesh"] = [int(self.device_mesh[d].size()) for d in MESH_DIMS]
        return entry

    def _restore_shards(self, checkpoint: dict[str, Any], path: _PATH, weights_only: bool | None) -> None:
        """Restore this process's sparse state from a loaded ``checkpoint`` written on the same mesh."""
        entry, shape = checkpoint.get(CHECKPOINT_KEY), [int(self.device_mesh[d].size()) for d in MESH_DIMS]
        if entry is None:
            raise ValueError(f"{str(path)!r} holds no lightning_sparse state: it was not written by SparseFSDPStrategy")
        if entry.get("mesh") != shape:
            raise ValueError(
                f"the checkpoint {str(path)!r} was written on a mesh of {entry.get('mesh')} (groups, shard_size) and "
                f"is resumed on {shape}: SparseFSDPStrategy resumes on the same number of processes and shard_size"
            )
        self._restore_sparse(checkpoint, path, True, weights_only)


def sharding_units(module: torch.nn.Module, sharded_modules: list[str]) -> list[torch.nn.Module]:
    """The modules :func:`shard_module` makes FSDP2 units of, in order: every module whose class is named in
    ``sharded_modules`` (inner ones first), every direct child of ``module`` around such blocks that holds other
    parameters, then ``module`` (whose own layers stay in its unit). A module that shares a parameter with one
    outside it is no unit: FSDP2 manages each parameter in exactly one unit."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(m)

    def shares_outside(m: torch.nn.Module) -> bool:
        inside = {id(x) for x in m.modules()}
        return any(id(h) not in inside for p in m.parameters() for h in holders[id(p)])

    names = set(sharded_modules)
    depth = {id(m): name.count(".") for name, m in module.named_modules() if name}
    listed = [m for m in module.modules() if m is not module and type(m).__name__ in names]
    # inner units first: FSDP2 leaves a unit's parameters out of the units sharded after it around it
    listed.sort(key=lambda m: -depth[id(m)])
    units = [m for m in listed if any(True for _ in m.parameters()) and not shares_outside(m)]
    covered = {id(p) for u in units for p in u.parameters()}
    for child in module.children():
        if any(child is u for u in units) or shares_outside(child):
            continue
        # only a child around listed blocks (self.model); the root's own layers stay in its unit
        holds_blocks = any(any(m is u for u in units) for m in child.modules())
        if holds_blocks and any(id(p) not in covered for p in child.parameters()):
            units.append(child)
            covered.update(id(p) for p in child.parameters())
    return [*units, module]


def shard_module(module: torch.nn.Module, mesh: Any, sharded_modules: list[str] | None, ours: bool) -> bool:
    """Shard ``module`` as :func:`sharding_units` says, or check that the caller did (``sharded_modules`` None);
    ``ours``: this strategy sharded it in an earlier run. Returns whether it was sharded here."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        if sharded_modules and not ours:  # (ours: fit, then validate)
            raise ValueError(
                f"sharded_modules={sharded_modules!r} is not allowed for a module that is sharded already (by "
                "configure_model or a parallelize_fn): expected None"
            )
        return False
    if not sharded_modules:
        raise TypeError(
            "SparseFSDPStrategy found no module sharded with fully_shard: shard the model yourself "
            "(fully_shard(module, mesh=device_mesh['shard']) in the LightningModule's configure_model, or in a "
            "parallelize_fn with Fabric), or name the module classes to shard in "
            "SparseFSDPStrategy(sharded_modules=[...])"
        )
    found = {type(m).__name__ for m in module.modules()}
    if not set(sharded_modules) & found:
        raise ValueError(
            f"sharded_modules={sharded_modules!r} names no module of the model: its module classes are {sorted(found)}"
        )
    for unit in sharding_units(module, sharded_modules):
        fully_shard(unit, mesh=mesh)
    return True


def reshard(module: torch.nn.Module) -> None:
    """Reshard every FSDP2 unit of ``module``: after a forward without backward the root keeps its gathered
    parameters, which FSDP2 would reuse although the exchange has written the shards since."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def count_group_traffic(module: torch.nn.Module, telemetry: Telemetry) -> None:
    """Count the ring-model bytes of FSDP2's collectives for ``module`` into ``telemetry.group_bytes`` (where this
    torch has FSDP2 collectives to wrap)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:
        return

    class _Counted:
        """An FSDP2 collective that records the bytes of its whole tensor (gathered or scattered) it moves."""

        gathers: bool

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, *args: Any, **kwargs: Any) -> Any:
            whole, size = output_tensor if self.gathers else input_tensor, dist.get_world_size(group)
            telemetry.record_group((size - 1) / size * whole.numel() * whole.element_size())
            return self.inner(output_tensor, input_tensor, group, *args, **kwargs)

    class _CountedAllGather(_Counted, AllGather):
        gathers = True

    class _CountedReduceScatter(_Counted, ReduceScatter):
        gathers = False

    counted = False
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before per-parameter meshes: one group or none
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        # torch's setters where it has them (one group a unit); before them, the groups' attributes
        public = len(groups) == 1 and hasattr(m, "set_custom_all_gather") and hasattr(m, "set_custom_reduce_scatter")
        for g in groups:
            gather, scatter = getattr(g, "_all_gather_comm", None), getattr(g, "_reduce_scatter_comm", None)
            if gather is None or scatter is None:
                continue
            # a wrapper from an earlier call (another class object) is unwrapped, not wrapped again
            gather = _CountedAllGather(getattr(gather, "inner", gather))
            scatter = _CountedReduceScatter(getattr(scatter, "inner", scatter))
            if public:
                m.set_custom_all_gather(gather)
                m.set_custom_reduce_scatter(scatter)
            else:
                g._all_gather_comm, g._reduce_scatter_comm = gather, scatter
            counted = True
    if counted and telemetry.group_bytes is None:
        telemetry.group_bytes = 0.0


def load_local_optimizer_states(module: torch.nn.Module, pairs: list[tuple[Optimizer, dict[str, Any]]]) -> None:
    """Give each optimizer the state this process saved (:func:`local_tree`), as DTensors again."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    params = dict(module.named_parameters())
    for optimizer, state in pairs:
        tree = {**state, "state": {name: _like_param(slot, params[name]) for name, slot in state["state"].items()}}
        set_optimizer_state_dict(module, optimizer, tree, options=StateDictOptions(full_state_dict=False))


def load_local_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load the :func:`local_tree` of a ``state_dict()`` on a process holding the same shards."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    slots = {i: _like_param(slot, params[int(i)]) for i, slot in state["state"].items()}
    optimizer.load_state_dict({**state, "state": slots})


def _like_param(slot: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """An optimizer slot's tensors of ``p``'s local shape made DTensors like ``p`` (a DTensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return slot
    local_shape = p.to_local().shape
    return {
        k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        if isinstance(v, torch.Tensor) and v.shape == local_shape and v.dim() > 0
        else v
        for k, v in slot.items()
    }


def local_tree(state: Any) -> Any:
    """An optimizer's ``state_dict()`` with every DTensor replaced by this process's local tensor."""
    return map_leaves(state, lambda x: x.to_local() if hasattr(x, "to_local") and hasattr(x, "placements") else x)
