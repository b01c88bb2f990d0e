"""The Fabric strategies' shared hooks: which model the module holds at each point of a user's loop."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH, Optimizable
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_sparse.strategies.checkpoint import CHECKPOINT_KEY
from lightning_sparse.strategies.ft_front import fabric_recovery
from lightning_sparse.strategies.shell import SparseShell

__all__ = ["FabricHooks"]

#: what ``fabric.save`` passes: the state to save, and a filter of its entries
_State = dict[str, Module | Optimizer | Any]
_Filter = dict[str, Callable[[str, Any], bool]] | None


class FabricHooks(SparseShell):
    """The hooks Fabric's ``SparseDDPStrategy`` and ``SparseFSDPStrategy`` share, on top of a Fabric strategy.

    In update mode a training forward lets the module hold this process's own view; ``optimizer.step()`` steps on
    it, exchanges, and leaves the global model in the module. An evaluation forward, ``get_module_state_dict``,
    ``fabric.save`` and ``fabric.load`` put the global model back (the first two recompute BatchNorm statistics on
    this process alone: a user may evaluate on one rank only).

    Example:
        >>> from lightning_sparse import FabricSparseDDPStrategy, FabricSparseFSDPStrategy
        >>> issubclass(FabricSparseDDPStrategy, FabricHooks) and issubclass(FabricSparseFSDPStrategy, FabricHooks)
        True
    """

    # a training forward ran whose backward has not: its graph holds the rank's view
    _graph_pending: bool = False
    #: the module the exchange is bound to, and the optimizers set up
    _module: Module | None = None
    _optimizers: list[Optimizer]
    precision: Any
    #: what ``fabric.save`` and ``fabric.load`` do in each front end (after the checks of the methods below)
    _save_with_sparse: Callable[[_PATH, _State, Any, _Filter], None]
    _load_with_sparse: Callable[[_PATH, Any, bool, bool | None], dict[str, Any]]

    def _binding(self, sharded: bool = False) -> tuple[Any, Callable[[], list[Any]], Any]:
        def optimizers() -> list[Any]:
            return self._optimizers

        return getattr(self.precision, "scaler", None), optimizers, fabric_recovery(optimizers, sharded)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check the optimizer against the configuration (known bad mixes are warned about)."""
        self._core.check_optimizers([optimizer], self._exchange_size, self._module)
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)  # type: ignore[misc]

    def _watch_forward(self, module: Module) -> None:
        """Update mode: the hook that chooses the model the module holds, before every other pre-forward hook."""
        if self._core.update is not None:
            module.register_forward_pre_hook(self._before_forward, prepend=True)

    def _before_forward(self, module: Module, args: Any) -> None:
        update = self._core.update
        if update is None:
            return
        if module.training and torch.is_grad_enabled():
            update.hold_local()
            self._graph_pending = True
        elif not self._graph_pending and not update.stepping:
            self._core.global_model(together=False)  # evaluation sees the global model

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)  # type: ignore[misc]
        self._graph_pending = False

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The optimizer step, then (update mode) the exchange."""
        core = self._core
        if core.replicas is not None and core.state.shares_gradients:  # (inline: the step's path stays short)
            core.replicas.gradients_ready(core.state)
        step = functools.partial(super().optimizer_step, optimizer, **kwargs)  # type: ignore[misc]
        output = self._gradient_step(step) if core.update is None else core.update.step(step, optimizer)
        self._graph_pending = False
        return output

    def save_checkpoint(
        self, path: _PATH, state: _State, storage_options: Any | None = None, filter: _Filter = None
    ) -> None:
        """Save ``state`` with the global model, and each process's sparse state in its own file in ``<path>.sparse/``
        (``fabric.save`` calls it on every process)."""
        if CHECKPOINT_KEY in state:
            raise ValueError(
                f"state[{CHECKPOINT_KEY!r}] is not allowed with {type(self).__name__}: the strategy saves its own "
                "state under that key; use another name."
            )
        self._save_with_sparse(path, state, storage_options, filter)

    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load the global model and the rest of ``state``, and give this process its own sparse state back."""
        self._core.hold_global()  # what the module held is replaced: it becomes the global model
        return self._load_with_sparse(path, state, strict, weights_only)

    def get_module_state_dict(self, module: Module) -> dict[str, Any | Tensor]:
        """The module's state with the global parameters (update mode)."""
        self._core.global_model(together=False)
        return super().get_module_state_dict(module)  # type: ignore[misc]
