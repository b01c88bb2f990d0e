"""Update mode's data parallelism without DDP's reducer.

In update mode every process steps its own optimizer on its own gradient and the exchange runs
after the step (:mod:`lightning_sparse.exchange.update`): no gradient is all-reduced, so the model
is not wrapped in ``DistributedDataParallel``, whose reducer would copy every gradient into its
buckets for nothing (and would have to be switched off from outside). :class:`Replicas` wraps it
instead and does what DDP did there that update mode still needs, as torchft's ``LocalSGD`` and
``DiLoCo`` do without DDP:

- the replicas start from rank 0's parameters and buffers (DDP's ``init_sync``);
- every forward starts from rank 0's buffers (DDP's ``broadcast_buffers`` / ``forward_sync_buffers``);
- the steps that need the gradients themselves get them, after the backward and before the
  optimizer step (:meth:`Replicas.gradients_ready`): a timed fallback's plain DDP steps average
  them (in buckets, through the state's exchange, counted like every other exchange), and under
  fp16 AMP the processes agree on a step a gradient scaler skips.
"""

from __future__ import annotations

import typing
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.futures import Future

from lightning_sparse.exchange.hook import communicate
from lightning_sparse.exchange.state import SparseState

__all__ = ["REPLICA_ARGS", "Replicas", "broadcast_from_first"]

#: the ``DistributedDataParallel`` arguments update mode takes: those :class:`Replicas` honours, and
#: DDP's reducer's own, which mean nothing without one (each process keeps its own gradient)
REPLICA_ARGS = frozenset(
    {"process_group", "broadcast_buffers", "forward_sync_buffers", "init_sync", "bucket_cap_mb"}
    | {"find_unused_parameters", "static_graph", "gradient_as_bucket_view"}
)
_DEFAULT_BUCKET_MB = 25.0  # DDP's default, for the plain DDP steps' gradient buckets


def broadcast_from_first(tensors: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` with the group's first process's, one broadcast per dtype and device.

    The copy goes through ``.data``, so the tensors' version counters stay as they were (a buffer
    saved for a backward is not "modified in place"), as DDP's buffer broadcast leaves them.
    """
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
    """A module replicated over a process group for update mode: no reducer, rank 0's state at the
    start and its buffers at every forward (see the module's docstring).

    Args:
        module: the model.
        process_group: the group of replicas (None: the default group).
        broadcast_buffers: as in DDP (None: True), deprecated there for ``forward_sync_buffers``.
        forward_sync_buffers: as in DDP (None: ``broadcast_buffers``; given, the buffers are synced at
            the start too).
        init_sync: as in DDP: start every replica from rank 0's parameters (and buffers).
        bucket_cap_mb: the plain DDP steps' gradient buckets, as in DDP (None: 25).
        find_unused_parameters: accepted for DDP's sake: without a reducer nothing waits for a
            gradient, and a parameter without one takes no part in a plain DDP step's average there.
        static_graph: accepted for DDP's sake: nothing to record without a reducer.
        gradient_as_bucket_view: accepted for DDP's sake: each gradient is its own tensor.

    Example:
        >>> import torch.distributed as dist
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
        #: the group of replicas
        group = dist.group.WORLD if process_group is None else process_group
        self.process_group = typing.cast(dist.ProcessGroup, group)
        if forward_sync_buffers is not None:
            self.sync_buffers, sync_buffers_at_start = bool(forward_sync_buffers), True
        else:
            self.sync_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
            sync_buffers_at_start = self.sync_buffers
        self.bucket_bytes = int((_DEFAULT_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
        self._buckets: list[list[Tensor]] | None = None
        self._sync_each_forward = self.sync_buffers and any(True for _ in module.buffers())
        if init_sync:
            start = [p for p in module.parameters()] + (list(module.buffers()) if sync_buffers_at_start else [])
            broadcast_from_first(start, self.process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_each_forward:  # a module without buffers: not a Python call per submodule a step
            broadcast_from_first(list(self.module.buffers()), self.process_group)  # read each time, as DDP
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ the steps that need gradients
    def gradients_ready(self, state: SparseState) -> None:
        """After the backward, before the optimizer step, on every process: a timed fallback's plain
        DDP step averages the gradients; under fp16 AMP the processes agree on an overflow (then every
        gradient is NaN, and every scaler skips the step). Otherwise nothing: each keeps its own."""
        steps = state.step_exchange
        if steps.plain_ddp:
            self._average(state)
        elif steps.skips is not None:
            params = [p for p in self.module.parameters() if p.grad is not None]
            grads: list[Tensor] = [p.grad for p in params if p.grad is not None] or [torch.empty(0)]
            last: Future[Tensor] | None = None
            for i, grad in enumerate(grads):  # the agreement's one all-reduce leaves with the last
                last = steps.keep_gradient(grad, i == len(grads) - 1)
            assert last is not None
            last.wait()

    def _average(self, state: SparseState) -> None:
        """The gradients averaged as plain DDP averages them, in buckets of ``bucket_cap_mb`` (in reverse
        order of the parameters, as DDP's), through the state's exchange (dense on these steps); a
        parameter without a gradient here counts as zeros in the average."""
        buckets = self._buckets_of(state)
        futures: list[Future[Tensor]] = []
        for i, bucket in enumerate(buckets):
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket])
            futures.append(communicate(state, flat, bucket, is_last=i == len(buckets) - 1))
        for bucket, future in zip(buckets, futures, strict=True):
            average = future.wait()
            for p, value in zip(bucket, average.split([p.numel() for p in bucket]), strict=True):
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
