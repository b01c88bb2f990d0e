"""What a healing replica group takes from a healthy one besides the exchange's state: each front end's part."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lightning_sparse.exchange.ft import FrontEndState

__all__ = ["fabric_recovery", "trainer_recovery"]


def _optimizer_io(sharded: bool) -> tuple[Any, Any]:
    """(save, load) of one optimizer's state: as it is, or (FSDP2) its DTensors as this process's shards."""
    if not sharded:
        return (lambda o: o.state_dict()), (lambda o, saved: o.load_state_dict(saved))
    from lightning_sparse.strategies.sharding import load_local_optimizer_state, local_tree

    return (lambda o: local_tree(o.state_dict())), load_local_optimizer_state


def _inner(optimizer: Any) -> Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the optimizer


def trainer_recovery(strategy: Any, sharded: bool = False) -> FrontEndState:
    """A Trainer strategy's part: the optimizers' and schedulers' states and the step counters."""

    save_one, load_one = _optimizer_io(sharded)

    def save() -> dict[str, Any]:
        trainer = strategy.lightning_module.trainer
        loop = trainer.fit_loop.epoch_loop
        return {
            "optimizers": [save_one(_inner(o)) for o in strategy.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in strategy.lr_scheduler_configs],
            "global_step": trainer.global_step,
            "batches_that_stepped": loop.on_save_checkpoint()["_batches_that_stepped"],
        }

    def load(state: dict[str, Any]) -> None:
        for optimizer, saved in zip(strategy.optimizers, state["optimizers"], strict=True):
            load_one(_inner(optimizer), saved)
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


def fabric_recovery(optimizers: Any, sharded: bool = False) -> FrontEndState:
    """A Fabric strategy's part: the states of the ``optimizers()`` it set up."""

    save_one, load_one = _optimizer_io(sharded)

    def save() -> dict[str, Any]:
        return {"optimizers": [save_one(_inner(o)) for o in optimizers()]}

    def load(state: dict[str, Any]) -> None:
        for optimizer, saved in zip(optimizers(), state["optimizers"], strict=True):
            load_one(_inner(optimizer), saved)

    return save, load
