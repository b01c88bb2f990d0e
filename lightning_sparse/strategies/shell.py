"""The shell the Trainer and the Fabric strategies share: properties, starts, checkpoints, optimizer step."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from typing_extensions import Self

from lightning_sparse._utils import end_process_group_at_exit, note_run_end
from lightning_sparse.exchange.ft_env import shard_across_groups
from lightning_sparse.exchange.state import SparseState
from lightning_sparse.exchange.update import UpdateExchange
from lightning_sparse.strategies.core import STRATEGY_NAMES, SparseCore
from lightning_sparse.strategies.presets import PRESETS
from lightning_sparse.strategies.settings import take_settings

__all__ = ["SparseShell"]


class SparseShell:
    """What the Trainer and the Fabric strategies share on top of :class:`~lightning_sparse.strategies.core.SparseCore`.

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> isinstance(SparseDDPStrategy(), SparseShell)
        True
    """

    _core: SparseCore
    strategy_name = "sparse_ddp"
    #: the names the strategy registers (``strategies.core.STRATEGY_NAMES`` or ``FSDP_NAMES``)
    _names: tuple[tuple[str, str, dict[str, Any]], ...] = STRATEGY_NAMES
    # the Lightning strategy's
    global_rank: int
    world_size: int
    root_device: torch.device
    checkpoint_io: CheckpointIO

    def _take_settings(self, front: type, settings: dict[str, Any]) -> dict[str, Any]:
        """Build the core from the keyword arguments; return those of the Lightning strategy extended."""
        config, base_args, ddp_kwargs = take_settings(front, settings)
        self._core = SparseCore(config, ddp_kwargs=ddp_kwargs)
        return base_args

    def setup_environment(self) -> None:
        self._start_processes(super().setup_environment)  # type: ignore[misc]

    def _start_processes(self, start: Callable[[], None]) -> None:
        """Run ``start`` (``setup_environment``); the process group it created ends at interpreter exit everywhere."""
        created = not _distributed_is_initialized()
        start()
        end_process_group_at_exit(created=created)

    def teardown(self) -> None:
        """The Lightning strategy's teardown; the process group stays until interpreter exit, unless a run failed
        (the other ranks may never get there)."""
        note_run_end(failed=sys.exc_info()[1] is not None)
        super().teardown()  # type: ignore[misc]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every process trains on batches of its own; fault-tolerant: sharded over every replica group's."""
        kwargs = {"num_replicas": self.world_size, "rank": self.global_rank}
        return shard_across_groups(kwargs, self._core.config.fault_tolerant)

    @property
    def _exchange_size(self) -> int:  # the processes the exchange runs across
        return self.world_size

    @classmethod
    def preset(cls, name: str, **arguments: Any) -> Self:
        """The strategy at a preset of ``lightning_sparse.strategies.presets.PRESETS``, ``arguments`` on top.

        Example:
            >>> from lightning_sparse import SparseDDPStrategy
            >>> config = SparseDDPStrategy.preset("1000x", density=0.02).sparse_state.config
            >>> config.sync_every, config.schedule.density(0)
            (4, 0.02)
        """
        if name not in PRESETS:
            raise ValueError(f"preset={name!r} is not allowed: expected one of {list(PRESETS)}.")
        return cls(**{**PRESETS[name], **arguments})

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the strategy's names with a Trainer or Fabric strategy registry (idempotent)."""
        for name, description, params in cls._names:
            if name not in strategy_registry or strategy_registry[name].get("strategy") is not cls:
                strategy_registry.register(name, cls, description=description, override=True, **params)

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
        """Put the global model in the module (update mode), on every process at the same point; for a Fabric loop
        that reads the parameters after its last step."""
        self._core.global_model()

    def flush_residuals(self, rounds: int | None = None) -> None:
        """Hand over what every process has not sent yet (update mode), on every process at the same point.

        ``rounds=None``: add the mean of the residuals to the global model exactly and empty them; ``rounds=R``: R more
        exchanges as configured.

        Example:
            >>> from lightning_sparse import SparseDDPStrategy
            >>> SparseDDPStrategy(compress="gradient").flush_residuals()
            Traceback (most recent call last):
            ...
            ValueError: flush_residuals() is not allowed with compress='gradient': expected compress='update' ...
        """
        self._core.flush_residuals(rounds)

    def end_fit(self) -> None:
        """After a Fabric loop's last optimizer step, on every process: :meth:`flush_residuals` as ``flush_at_end``
        says, then :meth:`global_model` (gradient mode: nothing to hand over)."""
        self._core.end_fit()

    def _bind(self, model: Any) -> None:
        """Bind the exchange to the model :meth:`SparseCore.wrap` made (and register DDP's hook in gradient mode)."""
        self._core.register_hook(model, self.global_rank, self.world_size, self.root_device, *self._binding())

    #: the gradient scaler, the optimizers and the front end's part of a healing group's state (Trainer or Fabric)
    _binding: Callable[..., tuple[Any, Callable[[], list[Any]], Any]]

    def _save_sparse(
        self, path: _PATH, optimizer_states: dict[str, Any] | None, storage_options: Any
    ) -> dict[str, Any]:
        """Write this process's sparse state beside the checkpoint at ``path``; the checkpoint's entry."""
        return self._core.checkpoint.save(
            path, self.global_rank, self.world_size, optimizer_states, self.checkpoint_io, storage_options
        )

    def _restore_sparse(self, checkpoint: dict[str, Any], path: _PATH, now: bool, weights_only: bool | None) -> None:
        self._core.checkpoint.restore(
            checkpoint, path, self.global_rank, self.world_size, self.checkpoint_io, self.root_device, now, weights_only
        )

    def _gradient_step(self, step: Callable[[], Any]) -> Any:
        """Gradient mode's optimizer ``step``: under fp16 AMP a skipped step gives back what it took from the
        residuals. (Update mode's is :meth:`UpdateExchange.step`.)"""
        output = step()
        state = self._core.state
        if state.skips is not None:
            state.skips.after_step(state.memory, state.velocity)
        return output
