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


@dataclass(frozen=True)
class Issued:
    """A collective in flight: its future, and what it is (for the error that says where a stalled
    exchange was)."""

    future: Future[list[Tensor]]
    what: str


class CollectiveError(RuntimeError):
    """A collective failed or timed out; ``what`` says which (e.g. ``"all-gather of 1,064 bytes"``)."""

    def __init__(self, what: str, cause: BaseException) -> None:
        self.what = what
        self.cause = first_line(cause)
        super().__init__(f"{what} failed: {self.cause}")


def first_line(error: BaseException) -> str:
    """The gist of a (possibly nested) collective error: its innermost message's first line."""
    text = str(error)
    marker = "Got the following error when running the callback: "
    while marker in text:
        text = text.split(marker, 1)[1]
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


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

    def all_reduce(self, tensor: Tensor, counters: Counters | None = None) -> Issued | None:
        """Sum ``tensor`` in place over the group."""
        if counters is not None:
            count_all_reduce(counters, self.world, _nbytes(tensor))
        if self.world <= 1:
            return None
        return Issued(all_reduce(tensor, self.group), f"all-reduce of {_nbytes(tensor):,} bytes")

    def all_gather(self, output: Tensor, tensor: Tensor, counters: Counters | None = None) -> Issued | None:
        """Concatenate every rank's ``tensor`` (same size on all ranks) into ``output``."""
        return self._into(all_gather, count_all_gather, "all-gather", output, tensor, counters)

    def all_to_all(self, output: Tensor, tensor: Tensor, counters: Counters | None = None) -> Issued | None:
        """Send chunk ``j`` of ``tensor`` (split evenly along dim 0) to rank ``j``; chunk ``r`` of
        ``output`` receives rank ``r``'s."""
        return self._into(all_to_all, count_all_to_all, "all-to-all", output, tensor, counters)

    def _into(
        self,
        issue: Callable[[Tensor, Tensor, dist.ProcessGroup | None], Future[list[Tensor]]],
        count: Callable[[Counters, int, int], None],
        name: str,
        output: Tensor,
        tensor: Tensor,
        counters: Counters | None,
    ) -> Issued | None:
        if counters is not None:
            count(counters, self.world, _nbytes(tensor))
        if self.world <= 1:
            output.copy_(tensor)  # one process: what it would receive is what it sends
            return None
        return Issued(issue(output, tensor, self.group), f"{name} of {_nbytes(tensor):,} bytes")


def futures(*maybe: Issued | None) -> list[Issued]:
    """The collectives that were issued (world size 1 issues none)."""
    return [f for f in maybe if f is not None]


def wait(issued: Issued | None) -> None:
    """Wait for a collective, if one was issued; a failure raises :class:`CollectiveError`."""
    if issued is not None:
        try:
            issued.future.wait()
        except Exception as error:
            raise CollectiveError(issued.what, error) from error
