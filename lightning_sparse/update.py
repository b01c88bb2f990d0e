"""Update compression: exchange part of each rank's optimizer progress after the step.

With ``compress="update"`` DDP's communication hook sends nothing: every rank's optimizer steps
on its own gradient. After the step, :class:`UpdateExchange` sends, per parameter, the
coordinates the compressor selects of ``u = e + delta`` (``delta``: what this rank's optimizer
just did to the parameter; ``e``: what the rank has not sent yet), through the same
:func:`~lightning_sparse.hook.communicate` as the gradient hook (same wire patterns, value
dtypes, density schedules, fallbacks and telemetry). Every rank adds the average of what the
ranks sent to the *global* parameters, and keeps the unsent part as its residual ``e``.

Between optimizer steps the module holds the global parameters, identical on every rank, so
validation, callbacks, checkpoints and the end of fit all see one model. For its own forward,
backward and optimizer step each rank adds its residual back (:meth:`UpdateExchange.enter_local`):
gradients are taken at ``global + e``, the rank's own view of the model, which is what trains
best (the unsent progress is not lost from the rank's view, only delayed for the others).

Conservation, per parameter and rank, exactly: ``sent + e_new == e_old + delta``, with
``delta = p_after - p_before`` computed in float32 from the parameter after and before the
optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse.hook import all_finite, communicate, local_gradient_hook
from lightning_sparse.state import SparseState

__all__ = ["UpdateExchange", "local_gradient_hook"]

#: parameters per exchanged message at most (bytes of float32 updates), like DDP's 25 MB buckets
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


class UpdateExchange:
    """Exchanges each rank's unsent optimizer progress after its optimizer steps.

    Args:
        state: the shared :class:`~lightning_sparse.state.SparseState` (compressor, density,
            residuals, telemetry); bound to the model's parameters by :meth:`bind`.
        bucket_bytes: the parameters of one optimizer are exchanged in messages of at most
            this many bytes of float32 updates (a larger parameter gets a message of its own).

    Example:
        >>> import torch
        >>> from lightning_sparse import SparseState
        >>> model = torch.nn.Linear(4, 2)
        >>> exchange = UpdateExchange(SparseState(compressor="topk", density=0.5))
        >>> exchange.bind(model.named_parameters())   # one process: plain training
        >>> exchange.active
        False
    """

    def __init__(self, state: SparseState, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.state = state
        self.bucket_bytes = int(bucket_bytes)
        #: name -> parameter (trainable, bound)
        self._params: dict[str, Tensor] = {}
        self._names: dict[int, str] = {}
        #: name -> the global value of a parameter while the module holds this rank's view
        self._global: dict[str, Tensor] = {}
        self._local: set[str] = set()
        #: per group of parameters (an optimizer's), its buckets and their update buffers
        self._buckets: dict[tuple[int, ...], list[tuple[list[Tensor], Tensor]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_params={}, _names={}, _global={}, _local=set(), _buckets={})
        return state

    # ------------------------------------------------------------------ binding
    def bind(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        process_group: dist.ProcessGroup | None = None,
        check_consistency: bool = True,
    ) -> None:
        """Attach to the model's parameters and process group (binds the state too)."""
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.state.bind(named, process_group=process_group, check_consistency=check_consistency)
        self._params = dict(named)
        self._names = {id(p): n for n, p in named}
        self._global = {}
        self._local = set()
        self._buckets = {}

    @property
    def active(self) -> bool:
        """Whether there is anything to exchange (more than one process)."""
        return self.state.world_size > 1

    def _names_of(self, params: Iterable[Tensor] | None) -> list[str]:
        if params is None:
            return list(self._params)
        return [self._names[id(p)] for p in params if id(p) in self._names]

    # ------------------------------------------------------------------ the rank's own view
    @torch.no_grad()
    def enter_local(self, params: Iterable[Tensor] | None = None) -> None:
        """Let the module hold this rank's view ``global + e`` of ``params`` (default: all).

        Called before the rank's forward/backward/optimizer step; parameters that already hold
        the rank's view are left as they are.
        """
        if not self.active:
            return
        memory = self.state.memory
        for name in self._names_of(params):
            if name in self._local:
                continue
            p = self._params[name]
            g = self._global.get(name)
            if g is None or g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                g = torch.empty_like(p, memory_format=torch.contiguous_format)
                self._global[name] = g
            g.copy_(p)
            e = memory.get(name) if name in memory else None
            if e is not None:
                p.add_(e.view_as(p))
            self._local.add(name)

    @torch.no_grad()
    def leave_local(self) -> None:
        """Put the global parameters back in the module (exact: the residuals keep the rest).

        For validation, checkpoints and the end of fit in the middle of a gradient-accumulation
        cycle; after an exchange the module already holds them.
        """
        for name in list(self._local):
            self._params[name].copy_(self._global[name])
        self._local.clear()

    # ------------------------------------------------------------------ the exchange
    def _buckets_for(self, names: list[str]) -> list[tuple[list[Tensor], Tensor]]:
        key = tuple(id(self._params[n]) for n in names)
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = []
            current: list[Tensor] = []
            size = 0
            for n in names:
                p = self._params[n]
                if current and size + 4 * p.numel() > self.bucket_bytes:
                    buckets.append(current)
                    current, size = [], 0
                current.append(p)
                size += 4 * p.numel()
            if current:
                buckets.append(current)
            device = self._params[names[0]].device
            buckets = [
                (ps, torch.empty(sum(p.numel() for p in ps), dtype=torch.float32, device=device)) for ps in buckets
            ]
            self._buckets[key] = buckets
        return buckets

    @torch.no_grad()
    def exchange(self, params: Iterable[Tensor] | None = None) -> None:
        """After an optimizer step on ``params`` (default: all): send, average, keep the rest.

        Every rank must call it at the same point with the same parameters (the collectives are
        issued here, in one order, from this thread). Afterwards the module holds the new global
        values of ``params``.
        """
        if not self.active:
            return
        names = [n for n in self._names_of(params) if n in self._local]
        if not names:
            return
        state = self.state
        memory = state.memory
        buckets = self._buckets_for(names)
        futures: list[Future[Tensor]] = []
        for i, (ps, buffer) in enumerate(buckets):
            pos = 0
            for p in ps:
                name = self._names[id(p)]
                seg = buffer[pos : pos + p.numel()]
                g = self._global[name].reshape(-1)
                e = memory.get(name) if name in memory else None
                # delta = p_after - p_before, p_before = global + e as the module held it (float32)
                if e is None:
                    seg.copy_(g)
                else:
                    torch.add(g, e, out=seg)
                torch.sub(p.reshape(-1), seg, out=seg)
                pos += p.numel()
            futures.append(communicate(state, buffer, ps, is_last=i == len(buckets) - 1))
        for (ps, _), future in zip(buckets, futures, strict=True):
            averaged = future.wait()
            pos = 0
            for p in ps:
                name = self._names[id(p)]
                seg = averaged[pos : pos + p.numel()]
                pos += p.numel()
                g = self._global[name]
                if all_finite(seg):
                    g.add_(seg.view_as(g))
                # else: some rank's update was not finite; every rank sees the same NaN average
                # and keeps the global value (that rank's residual kept its previous value)
                p.copy_(g)
                self._local.discard(name)
