"""SparseDDPStrategy for Lightning Fabric: ``Fabric(strategy="sparse_ddp")``.

The same sparse communication as the Trainer's :class:`lightning_sparse.SparseDDPStrategy` (one
:class:`~lightning_sparse.strategies.core.SparseCore` underneath: the same arguments, compressors, schedules,
fallbacks, both modes, the same checkpoint payload), for a loop the user writes::

    fabric = Fabric(accelerator="cpu", devices=2, strategy="sparse_ddp")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()

Update mode (``compress="update"``, the default) in such a loop: a *training* forward (module in
training mode, gradients enabled) lets the module hold this rank's own view of the model (the
global parameters plus what this rank has not sent yet); ``optimizer.step()`` steps on it, and an
exchange leaves the new *global* parameters, identical on every rank, in the module. With
``sync_every > 1`` the view stays in the module between exchanges. An evaluation forward
(``model.eval()`` or ``torch.no_grad()``) outside a pending backward, ``strategy.global_model()``,
:meth:`SparseDDPStrategy.save_checkpoint` (``fabric.save``) and
:meth:`SparseDDPStrategy.load_checkpoint` (``fabric.load``) put the global model in the module (in
the middle of a cycle, the progress so far joins the residual first); the next training forward
puts the rank's view back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse._utils import end_process_group_at_exit
from lightning_sparse.compressors import Compressor
from lightning_sparse.config import SparseConfig
from lightning_sparse.exchange.fallback import TimedFallback
from lightning_sparse.exchange.ft import FaultTolerantUpdate
from lightning_sparse.exchange.ft_env import shard_across_groups
from lightning_sparse.exchange.outer import OuterStep
from lightning_sparse.fabric.fsdp import SparseFSDPStrategy
from lightning_sparse.fabric.hooks import FabricHooks
from lightning_sparse.schedules import DensitySchedule
from lightning_sparse.strategies.checkpoint import CHECKPOINT_KEY
from lightning_sparse.strategies.core import SparseCore, register_names, wrap_in_ddp
from lightning_sparse.strategies.ft_front import fabric_recovery

__all__ = ["SparseDDPStrategy", "register_fabric_strategies"]


class SparseDDPStrategy(FabricHooks, DDPStrategy):
    """Fabric's DDP whose communication is a sparse exchange with error feedback.

    The Fabric counterpart of the Trainer's ``lightning_sparse.SparseDDPStrategy``, with the same
    arguments and behaviour (see there and :mod:`lightning_sparse.fabric.ddp` for the loop): with
    ``compress="update"`` (the default) each rank's optimizer steps on its own gradient and part of
    each rank's progress is exchanged after ``optimizer.step()``; with ``compress="gradient"``
    DDP's communication hook sends part of each gradient plus residual during ``fabric.backward``.
    The hook is registered on every device (CPU/gloo included). At ``fabric.save`` every rank writes
    its own residuals (and in update mode its optimizer state) to a file of its own beside the
    checkpoint (``<path>.sparse/``), nothing gathered; ``fabric.load`` gives each rank its own
    back, so a resumed run continues exactly.
    ``fabric.strategy.sparse_state.telemetry`` holds the compression figures (there are no
    Trainer callbacks in Fabric: log them with ``fabric.log_dict`` if wanted).

    Args:
        compress: ``"update"``: compress each rank's optimizer update (trains close to dense with AdamW and
            with SGD + momentum; the exchange runs after the optimizer step); ``"gradient"``: compress the
            gradient before the step, in DDP's communication hook, bucket by bucket as backward hands them over
            (every bucket's collectives leave together after the last; suits plain SGD).
        compressor: a name from ``lightning_sparse.compressors.COMPRESSORS`` or a Compressor.
        density: fraction of each tensor sent per step, in (0, 1], or a density schedule.
        error_feedback: keep what was not sent and send it later.
        min_numel: tensors with fewer elements (biases, norms) are sent dense.
        warmup_steps: the first exchanges sent dense (gradient mode: >= 1, DDP learns its bucket order in
            the first step; update mode, whose messages are its own: >= 0).
        value_dtype: dtype of the values sent (``"float16"``, ``"bfloat16"``, ``"float32"``); None sends the
            gradient's dtype. Rounding errors go into the residual.
        seed: seed of every random choice (shared coordinates, samples).
        fallback_to_dense: ``True`` (or ``"bytes"``): send a bucket dense when the sparse exchange would
            move at least as many bytes as a dense all-reduce (all-gather traffic grows with world size).
            ``"time"`` (or a ``TimedFallback``): that, and after warm-up time a few dense and sparse steps
            on this link and send everything dense if dense was faster (fast links, where the hook's own
            passes cost more than the bytes they save). ``False``: always sparse after warm-up.
        momentum_correction: DGC's momentum correction (e.g. 0.9; gradient mode): the hook keeps each rank's
            momentum ``u <- m*u + g``, runs error feedback on it and zeroes what was sent in ``u`` too
            (momentum factor masking), so coordinates that wait long do not hit an optimizer momentum all at
            once. Use it with an optimizer without momentum (``SGD(momentum=0)``; checked at setup). 0
            (default) turns it off.
        exchange: how the selections of compressors that pick their own coordinates (pattern ``"gather"``) are
            combined: ``"allgather"`` (every rank gets every rank's pairs; traffic per rank grows with the
            number of ranks), ``"split"`` (a sparse all-reduce after Ok-Topk: traffic per rank about flat in
            the number of ranks; the global selection keeps about ``k`` coordinates per bucket tensor),
            ``"auto"`` (default): per bucket, the split where it moves at most a quarter of the all-gather's
            bytes (from about 16 ranks), else the all-gather.
        compact_indices: send indices in an exact Rice code of their gaps (about 1.1 bytes each at density
            0.01 instead of 4) wherever that is smaller; ``False``: int32.
        sync_every: update mode: each rank takes this many optimizer steps on its own, then exchanges the
            compressed sum of its progress since the last exchange plus what it has not sent yet (local SGD,
            DiLoCo's ``H``); 1 (default): every step. Between exchanges the module keeps the rank's own view,
            the global model aside; validation, checkpoints and the end of fit get the global model.
        outer_optimizer: update mode: what the global parameters do with each exchange's average. None (default): add it
            in, with the coordinates each party chose on its own scaled by half the number of parties where there are
            more than 2 (:class:`~lightning_sparse.exchange.outer.AddAverage`; ``AddAverage(chosen_scale=1.0)`` adds the
            plain average); ``"nesterov"``: DiLoCo's outer step, SGD with lr 0.7, momentum 0.9, Nesterov, stepped with
            the negated average as the gradient; or any optimizer class or factory (``functools.partial(torch.optim.SGD,
            lr=0.7, momentum=0.9, nesterov=True)``; ``class_path``/``init_args`` in a CLI config); or an
            :class:`~lightning_sparse.exchange.outer.OuterStep` of your own. Its state is in every checkpoint.
        value_bits: send the values of a sparse exchange (the selected ones and those of the small
            tensors sent whole beside them) as codes of 2, 4 or 8 bits with a bfloat16 scale per 64 values
            (2 bits: ternary, ``{-m, 0, m}``); the quantization error stays in the residual. None (default):
            values in ``value_dtype``. Compressors that pick their own coordinates (pattern
            ``"gather"``) only.
        batchnorm_batches: update mode: where the module is given the global model for something other than
            training (validation, testing, prediction, checkpoints, the end of fit), the running statistics of
            its BatchNorm layers are recomputed under the global parameters from the inputs of this many of the
            latest training forward passes (kept by reference), and averaged over the processes: gathered in
            the forward passes of each process's own view, they fit the view, not the global model. 0 turns it
            off; a module without BatchNorm is not touched.
        flush_at_end: update mode: at the end of a Trainer fit (a Fabric loop: ``strategy.end_fit()``), add the
            mean of every process's residual, what it has not sent yet, to the global model, exactly (one dense
            float32 all-reduce of the exchanged parameters, counted apart in the summary), so that what is
            validated, tested, saved and returned holds every process's progress. False: the global model as the
            last exchange left it.
        max_nonfinite_steps: update mode: a process whose optimizer update of a parameter is not finite drops
            it, puts that parameter back to its global value and resets its optimizer state for it (its next
            finite gradient counts again), with a warning, counted as ``sparse/nonfinite_updates``; after this
            many consecutive optimizer steps with a non-finite update the fit stops with an error naming the
            process and the step. 0: never stop.
        sync_delay: update mode with ``sync_every > 1``: launch each exchange without waiting and apply its
            average this many optimizer steps later (at most ``sync_every``), the local steps going on while it
            travels (Streaming DiLoCo's overlap); meanwhile the process's view keeps its own sent part.
            Validation, checkpoints and the end of fit apply exchanges in flight first. 0 (default): wait for
            each exchange.
        fragments: update mode with ``sync_every > 1``: split the parameters into this many fragments of about
            equal size, each exchanged once per cycle at its own step (staggered evenly over the cycle, as
            Streaming DiLoCo syncs its fragments), so one exchange carries about ``1 / fragments`` of the model;
            1 (default): the whole model at once.
        fragment_split: how ``fragments`` are made: ``"strided"`` (default): each parameter tensor, in module
            order, joins the fragment with the fewest elements so far (equal blocks go round robin, block i to
            fragment i mod F, as Streaming DiLoCo's strided pattern); ``"contiguous"``: runs of consecutive
            tensors cut at equal shares of the elements.
        offload_global: update mode: keep the global copy of the parameters (and an outer optimizer's state) in
            CPU memory, pinned where CUDA is available, as INTELLECT-1 kept DiLoCo's outer state; an exchange
            stages one bucket at a time on the device. The residual stays on the device.
        offload_residual: update mode: keep the residual (what each process has not sent yet) in CPU memory; an
            exchange copies each bucket's residuals to the device and back. With ``offload_global`` the device
            holds only the model (under ``sparse_fsdp``, its shards), gradients and optimizer state between
            exchanges.
        fault_tolerant: update mode: this job is one replica group of several that meet on torchft at each
            exchange (``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``); a group that dies
            does not stop the others and heals when it comes back (docs/fault-tolerance.md). Under
            ``sparse_fsdp`` the job is one shard group (``shard_size`` None).
        min_replicas: ``fault_tolerant``: the fewest replica groups an exchange runs with; fewer wait.
        quorum_timeout: ``fault_tolerant``: seconds a quorum, an exchange's collective or a recovery may take.
        find_unused_parameters: as in DDP.
        static_graph: as in DDP.
        gradient_as_bucket_view: as in DDP; ``None`` (default): ``True`` with ``compress="update"`` (DDP's
            buckets carry nothing there, so gradients living in them saves two copies of every gradient per
            step), ``False`` with ``compress="gradient"`` (DDP's default).
        bucket_cap_mb: as in DDP (None: DDP's default, 25); in update mode also the exchange's buckets (None:
            1024, so that a model of up to 256M float32 parameters is exchanged as one; 25 when offloading).
        accelerator: as in Fabric's ``DDPStrategy``.
        parallel_devices: as in Fabric's ``DDPStrategy``.
        cluster_environment: as in Fabric's ``DDPStrategy``.
        checkpoint_io: as in Fabric's ``DDPStrategy``.
        precision: as in Fabric's ``DDPStrategy``.
        process_group_backend: as in Fabric's ``DDPStrategy``.
        timeout: as in Fabric's ``DDPStrategy``.
        start_method: the launcher's start method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        **kwargs: further arguments of ``DistributedDataParallel``.

    Example:
        >>> import lightning_sparse
        >>> from lightning.fabric import Fabric
        >>> fabric = Fabric(accelerator="cpu", devices=2, strategy="sparse_ddp")  # doctest: +SKIP
        >>> strategy = SparseDDPStrategy(compressor="gaussiank", density=0.001)
        >>> fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)  # doctest: +SKIP
    """

    strategy_name = "sparse_ddp"

    def __init__(
        self,
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
        flush_at_end: bool = True,
        max_nonfinite_steps: int = 8,
        sync_delay: int = 0,
        fragments: int = 1,
        fragment_split: Literal["strided", "contiguous"] = "strided",
        offload_global: bool = False,
        offload_residual: bool = False,
        fault_tolerant: bool = False,
        min_replicas: int = 1,
        quorum_timeout: float = 60.0,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool | None = None,
        bucket_cap_mb: float | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        self._core = SparseCore(SparseConfig.of(locals()), ddp_kwargs=kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **self._core.ddp_kwargs,
        )
        self._ddp_model: DistributedDataParallel | None = None
        self._optimizers: list[Optimizer] = []  # those set up, for update mode's switch to plain DDP steps

    # ------------------------------------------------------------------ start and end
    @override
    def setup_environment(self) -> None:
        """Fabric's setup (``fabric.launch()``); the process group is then ended at interpreter exit.

        Fabric calls no teardown when the user's loop ends, so the end is registered here: at
        exit, before Python's shutdown, a barrier of every rank and (if this setup created the
        group) ``destroy_process_group``; nothing when the process leaves on an uncaught
        exception (``lightning_sparse._utils.end_process_group_at_exit``)."""
        created = not _distributed_is_initialized()
        super().setup_environment()
        end_process_group_at_exit(created=created)

    # ------------------------------------------------------------------ setup
    @override
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # fault-tolerant: shard over every replica group's processes, as torchft's DistributedSampler does
        return shard_across_groups(super().distributed_sampler_kwargs, self._core.config.fault_tolerant)

    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap the module in DDP and register the sparse communication on it (any device)."""
        model = wrap_in_ddp(module, self._determine_ddp_device_ids(), self._ddp_kwargs)  # not Lightning's side stream
        scaler = getattr(self.precision, "scaler", None)
        self._core.register_hook(
            model, self.global_rank, self.world_size, self.root_device, scaler, optimizers=lambda: self._optimizers
        )
        if isinstance(self._core.update, FaultTolerantUpdate):  # a healing group takes the optimizers' states too
            self._core.update.front_end = fabric_recovery(lambda: self._optimizers)
        self._watch_forward(model)
        self._ddp_model = model
        return model

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check the optimizer against the configuration (momentum correction, known bad mixes)."""
        module = self._ddp_model.module if self._ddp_model is not None else None
        self._core.check_optimizers([optimizer], self.world_size, module)
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save ``state`` (rank 0 writes it) and every rank's sparse state beside it.

        Runs on every rank (``fabric.save`` calls it on all): each rank writes its residuals, step,
        schedule and telemetry, and in update mode its optimizer states (each rank's optimizer
        followed its own gradients), to its own file in ``<path>.sparse/``; the checkpoint holds a
        small entry under ``"lightning_sparse"`` that names that folder.
        """
        self._check_state_keys(state)
        self._core.global_model()  # the checkpoint holds the global model (every rank saves together)
        converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
        optimizers = [k for k, obj in state.items() if isinstance(obj, Optimizer) and k in converted]
        optimizer_states = {k: converted[k] for k in optimizers}
        entry = self._save_sparse(path, optimizer_states or None, storage_options)
        if self.is_global_zero:
            converted[CHECKPOINT_KEY] = entry
            self.checkpoint_io.save_checkpoint(checkpoint=converted, path=path, storage_options=storage_options)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint like Fabric's ``DDPStrategy`` and restore this rank's sparse state.

        In update mode every optimizer in the checkpoint is restored to the state *this rank*
        saved (also in the returned checkpoint when ``state`` is empty); on another number of
        processes, to the mean of the saved ranks' states. The ``"lightning_sparse"`` entry is
        consumed, not returned.
        """
        self._core.hold_global()  # what the module held is replaced: it becomes the global model
        io = self.checkpoint_io
        # Lightning's own loading code runs; the checkpoint it reads passes through _restore first
        self.checkpoint_io = _RestoringIO(io, self._restore)
        try:
            return super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        finally:
            self.checkpoint_io = io

    def _restore(self, checkpoint: Any, path: _PATH, weights_only: bool | None) -> Any:
        """Take the sparse state out of a loaded checkpoint and give this rank its own optimizer states."""
        if isinstance(checkpoint, dict) and CHECKPOINT_KEY in checkpoint:
            self._restore_sparse(checkpoint, path, self._ddp_model is not None, weights_only)
        return checkpoint

    # ------------------------------------------------------------------ names
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``sparse_ddp`` and its variants with a Fabric strategy registry (idempotent)."""
        register_names(cls, strategy_registry)


def register_fabric_strategies() -> None:
    """Make ``Fabric(strategy="sparse_ddp")``, its variants and ``"sparse_fsdp"`` resolve (idempotent)."""
    SparseDDPStrategy.register_strategies(STRATEGY_REGISTRY)
    SparseFSDPStrategy.register_strategies(STRATEGY_REGISTRY)


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
