"""The collectives the package issues, each counted where it is issued.

:class:`Collectives` wraps ``torch.distributed``'s collectives for one process group: each call
counts the bytes it hands over and their ring traffic into the given
:class:`~lightning_sparse.stats.Counters` (so no collective goes uncounted, and none is counted
twice), and returns the collective's future, or None at world size 1, where nothing is issued.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse.stats import Counters
from lightning_sparse.wire.cost import count_all_gather, count_all_reduce, count_all_to_all


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# The raw collectives (module functions, looked up at every call: a test may stand in its own to
# read what crosses the wire).
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


@dataclass(frozen=True)
class Collectives:
    """Asynchronous collectives over ``group`` (``world`` processes), counted into ``counters``.

    Example:
        >>> import torch
        >>> from lightning_sparse.stats import Counters
        >>> c = Counters()
        >>> Collectives(group=None, world=1).all_reduce(torch.ones(4), c) is None, c.sent_bytes
        (True, 16)
    """

    group: dist.ProcessGroup | None = None
    world: int = 1

    def all_reduce(self, tensor: Tensor, counters: Counters | None = None) -> Future[list[Tensor]] | None:
        """Sum ``tensor`` in place over the group."""
        if counters is not None:
            count_all_reduce(counters, self.world, _nbytes(tensor))
        return None if self.world <= 1 else all_reduce(tensor, self.group)

    def all_gather(
        self, output: Tensor, tensor: Tensor, counters: Counters | None = None
    ) -> Future[list[Tensor]] | None:
        """Concatenate every rank's ``tensor`` (same size on all ranks) into ``output``."""
        return self._into(all_gather, count_all_gather, output, tensor, counters)

    def all_to_all(
        self, output: Tensor, tensor: Tensor, counters: Counters | None = None
    ) -> Future[list[Tensor]] | None:
        """Send chunk ``j`` of ``tensor`` (split evenly along dim 0) to rank ``j``; chunk ``r`` of
        ``output`` receives rank ``r``'s."""
        return self._into(all_to_all, count_all_to_all, output, tensor, counters)

    def _into(
        self,
        issue: Callable[[Tensor, Tensor, dist.ProcessGroup | None], Future[list[Tensor]]],
        count: Callable[[Counters, int, int], None],
        output: Tensor,
        tensor: Tensor,
        counters: Counters | None,
    ) -> Future[list[Tensor]] | None:
        if counters is not None:
            count(counters, self.world, _nbytes(tensor))
        if self.world <= 1:
            output.copy_(tensor)  # one process: what it would receive is what it sends
            return None
        return issue(output, tensor, self.group)


def futures(*maybe: Future[list[Tensor]] | None) -> list[Future[list[Tensor]]]:
    """The futures of the collectives that were issued (world size 1 issues none)."""
    return [f for f in maybe if f is not None]


def wait(future: Future[list[Tensor]] | None) -> None:
    """Wait for a collective, if one was issued."""
    if future is not None:
        future.wait()
