"""The Trainer strategies' shared hooks: which model the module holds at each point of a fit."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn

from lightning_sparse._utils import check_int
from lightning_sparse.strategies.checkpoint import CheckpointPayload
from lightning_sparse.strategies.ft_front import trainer_recovery
from lightning_sparse.strategies.monitor import CompressionMonitor
from lightning_sparse.strategies.shell import SparseShell

__all__ = ["FlushResiduals", "GlobalModelFirst", "TrainerHooks"]


class GlobalModelFirst(pl.Callback):
    """Puts the global model in the module before any other callback sees the start of validation, testing,
    prediction or the end of fit; first among the Trainer's callbacks, in update mode."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def _global_model(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.core.global_model()

    on_validation_start = on_test_start = on_predict_start = _global_model

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the hand-over (flush_at_end), before the monitor's summary counts it; a user's FlushResiduals does its own
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        if any(isinstance(cb, FlushResiduals) for cb in callbacks):
            self.core.global_model()
        else:
            self.core.end_fit()


class FlushResiduals(pl.Callback):
    """At the end of fit (after its last checkpoint), ``flush_residuals(rounds)`` in place of ``flush_at_end``'s.

    Example:
        >>> callbacks = [FlushResiduals(rounds=8)]  # pl.Trainer(strategy="sparse_ddp", callbacks=callbacks)
        >>> callbacks[0].rounds
        8
    """

    def __init__(self, rounds: int | None = None) -> None:
        self.rounds = None if rounds is None else check_int("rounds", rounds, minimum=1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flush = getattr(trainer.strategy, "flush_residuals", None)
        if flush is None:
            raise TypeError(
                "FlushResiduals needs a sparse strategy (sparse_ddp, sparse_fsdp), got "
                f"{type(trainer.strategy).__name__}"
            )
        flush(self.rounds)


def _global_model_first(hook: str) -> Callable[[TrainerHooks], None]:
    """``TrainerHooks``'s ``hook``: the global model in the module, then the Lightning strategy's ``hook``."""

    def run(self: TrainerHooks) -> None:
        self._core.global_model()
        getattr(super(TrainerHooks, self), hook)()

    run.__name__ = run.__qualname__ = hook
    return run


class TrainerHooks(SparseShell):
    """The hooks ``SparseDDPStrategy`` and ``SparseFSDPStrategy`` share: in update mode the module holds this
    process's own view for its forward, backward and optimizer step, and the global model everywhere else.

    Example:
        >>> from lightning_sparse import SparseDDPStrategy, SparseFSDPStrategy
        >>> issubclass(SparseDDPStrategy, TrainerHooks) and issubclass(SparseFSDPStrategy, TrainerHooks)
        True
    """

    compression_monitor: bool
    is_global_zero: bool
    optimizers: list[torch.optim.Optimizer]
    precision_plugin: Any

    def _binding(self, sharded: bool = False) -> tuple[Any, Callable[[], list[Any]], Any]:
        return getattr(self.precision_plugin, "scaler", None), lambda: self.optimizers, trainer_recovery(self, sharded)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._core.hold_local()
        return super().training_step(*args, **kwargs)  # type: ignore[misc]

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Any,
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        core = self._core

        def ready() -> Any:
            output = closure()
            if core.replicas is not None and core.state.shares_gradients:  # a plain DDP step, fp16's overflow check
                core.replicas.gradients_ready(core.state)
            return output

        step = functools.partial(super().optimizer_step, optimizer, ready, model, **kwargs)  # type: ignore[misc]
        return self._gradient_step(step) if core.update is None else core.update.step(step, optimizer)

    # every rank is at these points together
    on_validation_start = _global_model_first("on_validation_start")
    on_test_start = _global_model_first("on_test_start")
    on_predict_start = _global_model_first("on_predict_start")
    on_train_end = _global_model_first("on_train_end")

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._core.global_model()
        return super().lightning_module_state_dict()  # type: ignore[misc]

    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)  # type: ignore[misc]
        # at the start of every run, in every process, before the callbacks' setup hooks: a monitor added here
        # runs all its hooks; one from the model's configure_callbacks() replaces it, as Lightning does
        trainer = model._trainer
        if trainer is None:
            return
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        if self._core.update is not None and not any(isinstance(cb, GlobalModelFirst) for cb in callbacks):
            callbacks.insert(0, GlobalModelFirst(self._core))
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.barebones
        if self.compression_monitor and fitting and not any(isinstance(cb, CompressionMonitor) for cb in callbacks):
            callbacks.append(CompressionMonitor())

    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        if self.is_global_zero:
            CheckpointPayload.remove(filepath)  # the processes' files beside it
