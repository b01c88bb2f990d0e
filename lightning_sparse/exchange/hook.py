"""DDP's communication hooks: thin adapters from DDP's buckets onto the step's exchange.

DDP calls a communication hook once per gradient bucket per optimizer step, on the autograd
thread, as soon as the bucket's gradients are ready, and waits for the returned future before the
optimizer step. Both hooks here hand the bucket to the state's
:class:`~lightning_sparse.exchange.step.StepExchange`, which owns the step:

- :func:`sparse_comm_hook` (gradient mode, and the plain DDP steps of update mode's timed
  fallback): compress, exchange, and write the average of what the ranks sent back into the
  bucket as the averaged dense gradient;
- :func:`update_comm_hook` (update mode): keep this rank's own gradient and send nothing (the
  exchange runs after the optimizer step, :mod:`lightning_sparse.exchange.update`); under fp16 AMP the
  ranks agree on overflowed steps here.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime
# (``bucket`` must be annotated with the class dist.GradBucket itself, not a string).

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse.exchange.state import SparseState

__all__ = ["communicate", "sparse_comm_hook", "update_comm_hook"]


def sparse_comm_hook(state: SparseState, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook (``ddp_model.register_comm_hook(state, sparse_comm_hook)``)."""
    return communicate(state, bucket.buffer(), bucket.parameters(), is_last=bucket.is_last())


def update_comm_hook(state: SparseState, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook of update mode: keep this rank's own gradient, send nothing; on the
    steps a timed fallback makes plain DDP steps, all-reduce the gradient as DDP does."""
    exchange = state.step_exchange
    if exchange.plain_ddp:
        return sparse_comm_hook(state, bucket)
    return exchange.keep_gradient(bucket.buffer(), bucket.is_last())


def communicate(state: SparseState, buffer: Tensor, params: list[Tensor], is_last: bool = True) -> Future[Tensor]:
    """Exchange one bucket: the body of :func:`sparse_comm_hook`, callable on plain tensors.

    ``buffer`` is the flat sum-ready local gradient of ``params`` (in their order); the returned
    future holds ``buffer`` overwritten with the average over ranks of what each rank sent.
    """
    plan = state.plan(buffer, params)
    return state.step_exchange.bucket(buffer, plan, last=is_last).then(lambda fut: fut.value().as_dense())
