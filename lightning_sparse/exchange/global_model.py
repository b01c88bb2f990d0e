"""Update mode's global model as values: copies of it, loaded, and the snapshot a rolled-back exchange restores."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["GlobalModel"]

CPU = torch.device("cpu")  # where offloaded global copies live


class GlobalModel:
    """The global model of an update exchange (:class:`~lightning_sparse.exchange.update.UpdateExchange`, which
    holds what these methods read) as values: what a healing replica group receives, what an exchange that did not
    commit goes back to.

    Example:
        >>> from lightning_sparse.exchange.state import SparseState
        >>> from lightning_sparse.exchange.update import UpdateExchange
        >>> exchange = UpdateExchange(SparseState(compressor="topk", density=0.5))
        >>> exchange.bind(torch.nn.Linear(2, 1).named_parameters())
        >>> sorted(exchange.global_values())
        ['bias', 'weight']
    """

    # held by the update exchange (described where it sets them)
    state: Any
    outer_step: Any
    offload: bool
    _params: dict[str, Tensor]
    _global: dict[str, Tensor]
    _local: set[str]
    _synced: dict[str, int]
    _in_flight: list[Any]

    def _place(self, p: Tensor) -> tuple[torch.device, bool]:
        """Where ``p``'s global copy lives, and whether it is pinned."""
        return (CPU, p.is_cuda) if self.offload else (p.device, False)

    def _hold_global(self, names: Iterable[str]) -> None:
        """Put the global values of ``names`` in the module."""
        for name in names:
            p = self._params[name]
            p.copy_(self._global[name])
            self._synced[name] = p._version
            self._local.discard(name)

    def global_values(self, cpu: bool = False) -> dict[str, Tensor]:
        """Copies of the global model's values, by name (``cpu``: in CPU memory)."""
        values = {n: self._global[n] if n in self._local else p for n, p in self._params.items()}
        return {n: (v.detach().cpu() if cpu else v.detach()).clone() for n, v in values.items()}

    @torch.no_grad()
    def load_global_values(self, values: dict[str, Tensor]) -> None:
        """Make ``values`` the global model, held in the module; exchanges in flight are dropped."""
        self._in_flight = []
        for name, p in self._params.items():
            value = values[name].to(p.device)
            p.copy_(value)
            g = self._global.get(name)
            if g is not None and g.shape == p.shape:
                g.copy_(value)
            self._synced[name] = p._version
            self._local.discard(name)

    def snapshot(self) -> dict[str, Any]:
        """What :meth:`restore` puts back (copies): this rank's views, the global model, the outer step, the state."""
        return {
            "views": {n: p.detach().clone() for n, p in self._params.items()},
            "global": self.global_values(),
            "local": set(self._local),
            "outer": copy.deepcopy(self.outer_step.state_dict()),
            "sparse": self.state.state_dict(copy=True),
        }

    @torch.no_grad()
    def restore(self, saved: dict[str, Any]) -> None:
        """Go back to a :meth:`snapshot` (an exchange that did not commit everywhere); nothing stays in flight."""
        self._in_flight = []
        self.state.load_state_dict(saved["sparse"])
        self.outer_step.load_state_dict(saved["outer"])
        for name, p in self._params.items():
            g = self._global.get(name)
            if g is None or g.shape != p.shape:
                g = self._global[name] = torch.empty_like(p)
            g.copy_(saved["global"][name])
            if name in saved["local"]:
                p.copy_(saved["views"][name])
                self._local.add(name)
        self._hold_global([n for n in self._params if n not in saved["local"]])
