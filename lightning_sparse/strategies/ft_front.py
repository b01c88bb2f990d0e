"""What a healing replica group takes from a healthy one besides the exchange's state: each front end's part."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_sparse.exchange.ft import FrontEndState
from lightning_sparse.strategies.sharding import load_local_optimizer_state, local_tree

__all__ = ["fabric_recovery", "trainer_recovery"]


def fabric_recovery(optimizers: Callable[[], list[Any]], sharded: bool = False) -> FrontEndState:
    """A Fabric strategy's part: the states of the ``optimizers()`` it set up (``sharded``: FSDP2's DTensors as
    this process's shards)."""

    def save() -> dict[str, Any]:
        states = (_inner(o).state_dict() for o in optimizers())
        return {"optimizers": [local_tree(s) if sharded else s for s in states]}

    def load(state: dict[str, Any]) -> None:
        for optimizer, saved in zip(optimizers(), state["optimizers"], strict=True):
            if sharded:
                load_local_optimizer_state(_inner(optimizer), saved)
            else:
                _inner(optimizer).load_state_dict(saved)

    return save, load


def trainer_recovery(strategy: Any, sharded: bool = False) -> FrontEndState:
    """A Trainer strategy's part: the optimizers' states (as :func:`fabric_recovery`), the schedulers' states and the
    step counters."""
    save_optimizers, load_optimizers = fabric_recovery(lambda: strategy.optimizers, sharded)

    def save() -> dict[str, Any]:
        trainer = strategy.lightning_module.trainer
        return {
            **save_optimizers(),
            "schedulers": [c.scheduler.state_dict() for c in strategy.lr_scheduler_configs],
            "global_step": trainer.global_step,
            "batches_that_stepped": trainer.fit_loop.epoch_loop.on_save_checkpoint()["_batches_that_stepped"],
        }

    def load(state: dict[str, Any]) -> None:
        load_optimizers(state)
        for config, saved in zip(strategy.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        module = strategy.lightning_module
        loop = module.trainer.fit_loop.epoch_loop
        if module.automatic_optimization:
            progress = loop.automatic_optimization.optim_progress.optimizer.step
        else:
            progress = loop.manual_optimization.optim_step_progress
        progress.total.ready = progress.total.completed = int(state["global_step"])
        loop.on_load_checkpoint({"_batches_that_stepped": int(state["batches_that_stepped"])})

    return save, load


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the optimizer
