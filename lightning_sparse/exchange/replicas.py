"""Update mode's data parallelism without DDP's reducer (no gradient is all-reduced in update mode)."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.futures import Future

from lightning_sparse.exchange.hook import communicate
from lightning_sparse.exchange.state import SparseState
from lightning_sparse.exchange.step import keep_gradient

__all__ = ["REPLICA_ARGS", "Replicas", "broadcast_from_first"]

_DEFAULT_BUCKET_MB = 25.0  # DDP's default


def broadcast_from_first(tensors: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` with the group's first process's, one broadcast per dtype and device, through
    ``.data`` as DDP does (a buffer saved for a backward is not "modified in place")."""
    kinds: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for same in kinds.values():
            flat = _flatten_dense_tensors(same)
            dist.broadcast(flat, src=source, group=group)
            torch._foreach_copy_([t.data for t in same], _unflatten_dense_tensors(flat, same))


class Replicas(torch.nn.Module):
    """A module replicated over a process group for update mode: rank 0's parameters and buffers at the start, its
    buffers at every forward, and the steps that need gradients (:meth:`gradients_ready`), without a reducer.

    Args:
        module: the model.
        process_group: the group of replicas (None: the default group).
        broadcast_buffers: as in DDP (None: True), deprecated there for ``forward_sync_buffers``.
        forward_sync_buffers: as in DDP (None: ``broadcast_buffers``; given, the buffers are synced at
            the start too).
        init_sync: as in DDP: start every replica from rank 0's parameters (and buffers).
        bucket_cap_mb: the plain DDP steps' gradient buckets, as in DDP (None: 25).
        find_unused_parameters, static_graph, gradient_as_bucket_view: accepted for DDP's sake (no reducer).

    Example:
        >>> from lightning_sparse._utils import free_port
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        >>> model = Replicas(torch.nn.BatchNorm1d(3))
        >>> model(torch.randn(4, 3)).shape, model.sync_buffers
        (torch.Size([4, 3]), True)
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        module: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        broadcast_buffers: bool | None = None,
        forward_sync_buffers: bool | None = None,
        init_sync: bool = True,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        group = dist.group.WORLD if process_group is None else process_group
        self.process_group = typing.cast(dist.ProcessGroup, group)
        legacy = True if broadcast_buffers is None else bool(broadcast_buffers)
        self.sync_buffers = legacy if forward_sync_buffers is None else bool(forward_sync_buffers)
        sync_buffers_at_start = self.sync_buffers or forward_sync_buffers is not None
        self.bucket_bytes = int((_DEFAULT_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
        self._buckets: list[list[Tensor]] | None = None
        self._sync_each_forward = self.sync_buffers and any(True for _ in module.buffers())
        if init_sync:
            start = list(module.parameters()) + (list(module.buffers()) if sync_buffers_at_start else [])
            broadcast_from_first(start, self.process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_each_forward:
            broadcast_from_first(list(self.module.buffers()), self.process_group)  # read each time, as DDP
        return self.module(*args, **kwargs)

    def gradients_ready(self, state: SparseState) -> None:
        """After the backward, on every process: a plain DDP step averages the gradients; under fp16 AMP the
        processes agree on an overflow. Otherwise each keeps its own."""
        if state.plain_ddp:
            self._average(state)
        elif state.skips is not None:
            grads: list[Tensor] = [p.grad for p in self.module.parameters() if p.grad is not None] or [torch.empty(0)]
            futures = [keep_gradient(state, grad, i == len(grads) - 1) for i, grad in enumerate(grads)]
            futures[-1].wait()

    def _average(self, state: SparseState) -> None:
        """The gradients averaged as DDP does, in its buckets (a missing gradient counts as zeros)."""
        buckets = self._buckets_of(state)
        futures: list[Future[Tensor]] = []
        for i, bucket in enumerate(buckets):
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket])
            futures.append(communicate(state, flat, bucket, is_last=i == len(buckets) - 1))
        for bucket, future in zip(buckets, futures, strict=True):
            for p, value in zip(bucket, future.wait().split([p.numel() for p in bucket]), strict=True):
                if p.grad is None:
                    p.grad = value.view_as(p).clone()
                else:
                    p.grad.copy_(value.view_as(p))

    def _buckets_of(self, state: SparseState) -> list[list[Tensor]]:
        if self._buckets is None:
            bound = set(map(id, state.parameters))
            params = [p for p in reversed(list(self.module.parameters())) if id(p) in bound]
            buckets: list[list[Tensor]] = []
            size = 0
            for p in params:
                nbytes = p.numel() * p.element_size()
                same = buckets and buckets[-1][0].dtype == p.dtype and buckets[-1][0].device == p.device
                if not same or size + nbytes > self.bucket_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append(p)
                size += nbytes
            self._buckets = buckets
        return self._buckets


#: the ``DistributedDataParallel`` arguments update mode takes (the reducer's own are accepted and ignored)
REPLICA_ARGS = frozenset(inspect.signature(Replicas).parameters) - {"module"}
