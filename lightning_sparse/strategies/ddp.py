"""SparseDDPStrategy: Lightning's DDP with sparse gradient communication."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse._utils import check_bool, end_process_group_at_exit
from lightning_sparse.compressors import Compressor
from lightning_sparse.config import SparseConfig
from lightning_sparse.exchange.fallback import TimedFallback
from lightning_sparse.exchange.ft import FaultTolerantUpdate
from lightning_sparse.exchange.ft_env import shard_across_groups
from lightning_sparse.exchange.outer import OuterStep
from lightning_sparse.schedules import DensitySchedule
from lightning_sparse.strategies.advice import training_advice
from lightning_sparse.strategies.checkpoint import CHECKPOINT_KEY
from lightning_sparse.strategies.core import SparseCore, register_names, wrap_in_ddp
from lightning_sparse.strategies.ft_front import trainer_recovery
from lightning_sparse.strategies.trainer_hooks import TrainerHooks

__all__ = ["CHECKPOINT_KEY", "SparseDDPStrategy", "register_strategies", "training_advice"]


class SparseDDPStrategy(TrainerHooks, DDPStrategy):
    """DDP whose gradient all-reduce is replaced by a sparse exchange with error feedback.

    Every optimizer step each parameter sends ``k = density * numel`` coordinates (chosen by
    ``compressor``) of what it has to send; what is not sent is kept and sent later, so nothing
    is lost, only delayed. With ``compress="update"`` (the default) every rank's optimizer steps
    on its own gradient and the strategy exchanges part of each rank's accumulated progress
    after the step; after an exchange the module holds the global parameters, identical on every
    rank (with ``sync_every > 1``, each rank's own view between exchanges). With
    ``compress="gradient"`` DDP's communication hook sends part of each gradient plus residual,
    every bucket's together after backward's last. Tensors below ``min_numel`` and the first
    ``warmup_steps`` steps go dense. Everything else is Lightning's ``DDPStrategy``: the
    launchers, NCCL/gloo, the buckets.

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
        compression_monitor: add a ``lightning_sparse.CompressionMonitor`` to the Trainer's callbacks when
            fitting, unless it already has one, so the compression figures reach the Trainer's loggers and a
            summary is printed at the end of fit. ``False`` adds nothing.
        find_unused_parameters: as in DDP.
        static_graph: as in DDP.
        gradient_as_bucket_view: as in DDP; ``None`` (default): ``True`` with ``compress="update"`` (DDP's
            buckets carry nothing there, so gradients living in them saves two copies of every gradient per
            step), ``False`` with ``compress="gradient"`` (DDP's default).
        bucket_cap_mb: as in DDP (None: DDP's default, 25); in update mode also the exchange's buckets (None:
            1024, so that a model of up to 256M float32 parameters is exchanged as one; 25 when offloading).
        accelerator: as in Lightning's ``DDPStrategy``.
        parallel_devices: as in Lightning's ``DDPStrategy``.
        cluster_environment: as in Lightning's ``DDPStrategy``.
        checkpoint_io: as in Lightning's ``DDPStrategy``.
        precision_plugin: as in Lightning's ``DDPStrategy``.
        process_group_backend: as in Lightning's ``DDPStrategy``.
        timeout: as in Lightning's ``DDPStrategy``.
        start_method: the launcher's start method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        **kwargs: further arguments of ``DistributedDataParallel``.

    Example:
        >>> import lightning_sparse
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy="sparse_ddp")  # doctest: +SKIP
        >>> strategy = SparseDDPStrategy(compressor="randomk", density=0.001)
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)  # doctest: +SKIP
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
        compression_monitor: bool = True,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool | None = None,
        bucket_cap_mb: float | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        check_bool("compression_monitor", compression_monitor)
        self._core = SparseCore(SparseConfig.of(locals()), ddp_kwargs=kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **self._core.ddp_kwargs,
        )
        self.compression_monitor = compression_monitor

    # ------------------------------------------------------------------ start and end
    @override
    def setup_environment(self) -> None:
        created = not _distributed_is_initialized()
        super().setup_environment()
        # ended on every rank together at interpreter exit, before Python's shutdown begins
        end_process_group_at_exit(created=created)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._core.check_optimizers(self.optimizers, self.world_size, self.lightning_module)

    # ------------------------------------------------------------------ the hook
    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        """DDP built on the current CUDA stream, not Lightning's side stream (see :func:`wrap_in_ddp`)."""
        return wrap_in_ddp(model, self.determine_ddp_device_ids(), self._ddp_kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning's DDPStrategy registers comm hooks only on CUDA; ours must run on every device.
        scaler = getattr(self.precision_plugin, "scaler", None)
        self._core.register_hook(
            self.model, self.global_rank, self.world_size, self.root_device, scaler, optimizers=lambda: self.optimizers
        )
        if isinstance(self._core.update, FaultTolerantUpdate):
            self._core.update.front_end = trainer_recovery(self)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # fault-tolerant: shard over every replica group's processes, as torchft's DistributedSampler does
        return shard_across_groups(super().distributed_sampler_kwargs, self._core.config.fault_tolerant)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Runs on every process: each writes its own sparse state beside the checkpoint, no gather.
        optimizer_states = (
            {"optimizer_states": checkpoint["optimizer_states"]} if "optimizer_states" in checkpoint else None
        )
        checkpoint[CHECKPOINT_KEY] = self._save_sparse(filepath, optimizer_states, storage_options)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if CHECKPOINT_KEY in checkpoint:
            # Restored before DDP wraps the model; applied when the hook is registered. In update mode
            # checkpoint["optimizer_states"] becomes this process's own.
            now = isinstance(self.model, DistributedDataParallel)
            self._restore_sparse(checkpoint, checkpoint_path, now, weights_only)
        return checkpoint

    # ------------------------------------------------------------------ names
    @classmethod
    def register_strategies(cls, strategy_registry: dict) -> None:
        """Register ``sparse_ddp`` and its variants (idempotent)."""
        register_names(cls, strategy_registry)


def register_strategies() -> None:
    """Make ``Trainer(strategy="sparse_ddp")`` and its variants resolve (idempotent)."""
    SparseDDPStrategy.register_strategies(StrategyRegistry)
