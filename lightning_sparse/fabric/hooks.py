"""The Fabric strategies' shared hooks: which model the module holds at each point of a user's loop."""

from __future__ import annotations

import sys
from typing import Any

import torch
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module

from lightning_sparse._utils import note_run_end
from lightning_sparse.strategies.checkpoint import CHECKPOINT_KEY
from lightning_sparse.strategies.shell import SparseShell

__all__ = ["FabricHooks"]


class FabricHooks(SparseShell):
    """The hooks Fabric's ``SparseDDPStrategy`` and ``SparseFSDPStrategy`` share, on top of a Fabric
    strategy (the next class in the method resolution order).

    In update mode a *training* forward (module in training mode, gradients enabled) lets the module
    hold this process's own view of the model; ``optimizer.step()`` steps on it, exchanges, and leaves
    the global model in the module. An evaluation forward outside a pending backward and
    ``get_module_state_dict`` put the global model back (BatchNorm statistics recomputed on this
    process alone: a user may evaluate on one rank only, where a collective would hang).

    Example:
        >>> from lightning_sparse import FabricSparseDDPStrategy, FabricSparseFSDPStrategy
        >>> issubclass(FabricSparseDDPStrategy, FabricHooks) and issubclass(FabricSparseFSDPStrategy, FabricHooks)
        True
    """

    # a training forward ran whose backward has not: its graph holds the rank's view
    _graph_pending: bool = False

    def _watch_forward(self, module: Module) -> None:
        """Update mode: register the forward hook that chooses the model the module holds. It runs
        before every other pre-forward hook (FSDP2 gathers the shards in one)."""
        if self._core.update is not None:
            module.register_forward_pre_hook(self._before_forward, prepend=True)

    def _before_forward(self, module: Module, args: Any) -> None:
        update = self._core.update
        if update is None:
            return
        if module.training and torch.is_grad_enabled():
            update.hold_local()  # this rank's forward/backward run at global + its residual
            self._graph_pending = True
        elif not self._graph_pending and not self._in_optimizer_step:
            self._core.global_model(together=False)  # evaluation sees the global model

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)  # type: ignore[misc]
        self._graph_pending = False

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The optimizer step on this rank's view, then (update mode) the exchange: afterwards the
        module holds the new global values of the optimizer's parameters."""
        strategy = super()
        self._gradients_ready()  # after the backward: what the step needs of the gradients

        def step() -> Any:
            return strategy.optimizer_step(optimizer, **kwargs)  # type: ignore[attr-defined]

        output = self._sparse_step(optimizer, step)
        self._graph_pending = False
        return output

    def _check_state_keys(self, state: dict[str, Any]) -> None:
        """Refuse a user's entry under the key the strategy saves its own state under (ValueError)."""
        if CHECKPOINT_KEY in state:
            raise ValueError(
                f"state[{CHECKPOINT_KEY!r}] is not allowed with {type(self).__name__}: the strategy saves its own "
                "state under that key; use another name."
            )

    def get_module_state_dict(self, module: Module) -> dict[str, Any | Tensor]:
        """The module's state with the global parameters (update mode)."""
        self._core.global_model(together=False)
        return super().get_module_state_dict(module)  # type: ignore[misc]

    def teardown(self) -> None:
        """Fabric's teardown, for a caller that runs it; an exception on its way out keeps the exit
        handler from ending the process group (the other ranks may never get there)."""
        note_run_end(failed=sys.exc_info()[1] is not None)
        super().teardown()  # type: ignore[misc]
