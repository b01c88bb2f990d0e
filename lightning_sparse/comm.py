"""Thin wrappers over torch.distributed collectives that return futures."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future


def all_reduce(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Future[list[Tensor]]:
    """Sum ``tensor`` in place over the group, asynchronously."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()


def all_gather(output: Tensor, tensor: Tensor, group: dist.ProcessGroup | None = None) -> Future[list[Tensor]]:
    """Concatenate every rank's ``tensor`` (same size on all ranks) into ``output``, asynchronously."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=True).get_future()


def all_to_all(output: Tensor, tensor: Tensor, group: dist.ProcessGroup | None = None) -> Future[list[Tensor]]:
    """Send chunk ``j`` of ``tensor`` (split evenly along dim 0) to rank ``j``; chunk ``r`` of
    ``output`` receives rank ``r``'s, asynchronously."""
    return dist.all_to_all_single(output, tensor, group=group, async_op=True).get_future()
