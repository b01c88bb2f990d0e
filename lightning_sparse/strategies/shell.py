"""The shell the Trainer and the Fabric strategies share: their properties, starts and optimizer step.

Besides: the samplers' shards and the checkpoint payload's save and restore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from typing_extensions import Self

from lightning_sparse._utils import end_process_group_at_exit
from lightning_sparse.exchange.ft_env import shard_across_groups
from lightning_sparse.exchange.state import SparseState
from lightning_sparse.exchange.update import UpdateExchange
from lightning_sparse.strategies.core import STRATEGY_NAMES, register_names
from lightning_sparse.strategies.presets import preset_settings

if TYPE_CHECKING:
    from lightning_sparse.strategies.core import SparseCore

__all__ = ["SparseShell"]


class SparseShell:
    """What the Trainer and the Fabric strategies share on top of :class:`SparseCore`: the
    properties they expose, the start of their processes, the samplers' shards and the update-mode
    optimizer step.

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> isinstance(SparseDDPStrategy(), SparseShell)
        True
    """

    _core: SparseCore
    #: the names the strategy registers (``strategies.core.STRATEGY_NAMES`` or ``FSDP_NAMES``)
    _names: tuple[tuple[str, str, dict[str, Any]], ...] = STRATEGY_NAMES
    _in_optimizer_step: bool = False
    # provided by the front end's strategy
    global_rank: int
    world_size: int
    root_device: torch.device
    checkpoint_io: CheckpointIO

    def _start_processes(self, start: Callable[[], None]) -> None:
        """Run the front end's ``setup_environment`` (``start``: the process group), then, where it
        created the group, end it at interpreter exit on every rank together
        (``lightning_sparse._utils.end_process_group_at_exit``): Fabric calls no teardown when the
        user's loop ends, and a Trainer's process group outlives its runs."""
        created = not _distributed_is_initialized()
        start()
        end_process_group_at_exit(created=created)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every process trains on batches of its own (under ``sparse_fsdp`` too, where FSDP2 averages
        a group's gradients); fault-tolerant, over every replica group's processes, as torchft's
        ``DistributedSampler`` shards them."""
        kwargs = {"num_replicas": self.world_size, "rank": self.global_rank}
        return shard_across_groups(kwargs, self._core.config.fault_tolerant)

    @classmethod
    def preset(cls, name: str, **arguments: Any) -> Self:
        """The strategy at a named point of the compression frontier
        (``lightning_sparse.strategies.presets.PRESETS``: ``"1000x"``, ``"2000x"``, ``"4000x"``),
        ``arguments`` on top (any of the strategy's own). ``Trainer(strategy="sparse_ddp_1000x")`` is the
        first as a name.

        Example:
            >>> from lightning_sparse import SparseDDPStrategy
            >>> SparseDDPStrategy.preset("1000x", density=0.02).sparse_state.config.sync_every
            4
        """
        return cls(**{**preset_settings(name), **arguments})

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the strategy's names (``sparse_ddp`` and its variants, or ``sparse_fsdp``) with a
        Trainer or Fabric strategy registry (idempotent)."""
        register_names(cls, strategy_registry, cls._names)

    @property
    def sparse_state(self) -> SparseState:
        """The sparse state on this rank: settings, residuals, step, telemetry."""
        return self._core.state

    @property
    def compress(self) -> str:
        """``"update"`` or ``"gradient"``: what is compressed."""
        return self._core.config.compress

    @property
    def update_exchange(self) -> UpdateExchange | None:
        """The update exchange (``compress="update"``), else None."""
        return self._core.update

    def global_model(self) -> None:
        """Put the global model in the module (update mode; nothing otherwise): every process calls
        it at the same point (BatchNorm statistics recomputed for it are averaged over them). In the
        middle of a cycle of local steps the module holds each process's own view; validation,
        checkpoints and the end of a Trainer fit do this themselves, a Fabric loop that reads the
        parameters after its last step calls it."""
        self._core.global_model()

    def flush_residuals(self, rounds: int | None = None) -> None:
        """Hand over what every process has not sent yet (update mode). ``rounds=None``: add the
        mean over processes of their residuals (and of the progress of local steps since the last
        exchange) to the global model, exactly, and empty the residuals, in one float32 all-reduce
        of the exchanged parameters. ``rounds=R``: R more exchanges of the residuals as configured
        (compressor, density, ``value_bits``, outer step), each due at once: R exchanges' bytes, the
        largest part of what is left each time, the rest kept. A Trainer fit and :meth:`end_fit`
        do the exact one at the end (``flush_at_end``); call it elsewhere on every process at the
        same point; the module then holds the global model.

        Example:
            >>> from lightning_sparse import SparseDDPStrategy
            >>> SparseDDPStrategy(compress="gradient").flush_residuals()
            Traceback (most recent call last):
            ...
            ValueError: flush_residuals() is not allowed with compress='gradient': expected compress='update' ...
        """
        self._core.flush_residuals(rounds)

    def end_fit(self) -> None:
        """Call after a Fabric loop's last optimizer step, on every process: what the processes have
        not sent yet joins the global model (:meth:`flush_residuals`, exactly; update mode with
        ``flush_at_end``, the default), and the module holds the global model
        (:meth:`global_model`), which is then what the loop evaluates and saves. A Trainer does it
        at the end of every fit.

        Example:
            >>> from lightning_sparse import SparseDDPStrategy
            >>> SparseDDPStrategy(compress="gradient").end_fit()  # gradient mode: nothing to hand over
        """
        self._core.end_fit()

    def _save_sparse(
        self, path: _PATH, optimizer_states: dict[str, Any] | None, storage_options: Any
    ) -> dict[str, Any]:
        """Write this process's sparse state beside the checkpoint at ``path``; the checkpoint's entry."""
        return self._core.checkpoint.save(
            path, self.global_rank, self.world_size, optimizer_states, self.checkpoint_io, storage_options
        )

    def _restore_sparse(self, checkpoint: dict[str, Any], path: _PATH, now: bool, weights_only: bool | None) -> None:
        """Restore this process's sparse state from a loaded ``checkpoint`` (see ``CheckpointPayload.restore``)."""
        self._core.checkpoint.restore(
            checkpoint, path, self.global_rank, self.world_size, self.checkpoint_io, self.root_device, now, weights_only
        )

    def _gradients_ready(self) -> None:
        """After the backward, before the optimizer step, on every process: in update mode what the
        step needs of the gradients (:meth:`Replicas.gradients_ready
        <lightning_sparse.exchange.replicas.Replicas.gradients_ready>`: a timed fallback's plain DDP
        step, fp16 AMP's overflow agreement); most steps need nothing."""
        core = self._core
        if core.replicas is not None:
            steps = core.state.step_exchange
            if steps.plain_ddp or steps.skips is not None:
                core.replicas.gradients_ready(core.state)

    def _sparse_step(self, optimizer: Any, step: Callable[[], Any]) -> Any:
        """Run the optimizer ``step``; in update mode on this rank's view of its parameters, then
        the exchange: afterwards the module holds the new global values of those parameters."""
        update = self._core.update
        if update is None:
            output = step()
            state = self._core.state
            skips = state.step_exchange.skips
            if skips is not None:  # fp16 AMP: a skipped step gives back what it took from the residuals
                skips.after_step(state.memory, state.velocity)
            return output
        params = [p for group in optimizer.param_groups for p in group["params"]]
        update.hold_local(params)
        self._in_optimizer_step = True
        try:
            output = step()
        finally:
            self._in_optimizer_step = False
        update.exchange(params)
        return output
