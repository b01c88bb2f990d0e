"""DDP's communication hook: a thin adapter from DDP's buckets onto the step's exchange."""

# No `from __future__ import annotations`: DDP checks the hook's annotations (dist.GradBucket) at runtime.

import functools

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse.exchange.state import SparseState
from lightning_sparse.exchange.step import bucket_rounds
from lightning_sparse.wire import Average, BucketPlan
from lightning_sparse.wire.comm import Rounds, run_together

__all__ = ["BackwardBatch", "communicate", "sparse_comm_hook"]


def sparse_comm_hook(state: SparseState, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook (``ddp_model.register_comm_hook(state, sparse_comm_hook)``)."""
    return communicate(state, bucket.buffer(), bucket.parameters(), is_last=bucket.is_last())


def communicate(state: SparseState, buffer: Tensor, params: list[Tensor], is_last: bool = True) -> Future[Tensor]:
    """Exchange one bucket (the body of :func:`sparse_comm_hook`): a future of ``buffer`` holding the average, to
    wait for only after the step's last bucket (``is_last``)."""
    if state.backward is None:
        state.backward = BackwardBatch()
    average = state.backward.add(state, buffer, state.plan(buffer, params), is_last)
    return average.then(lambda fut: fut.value().as_dense())


class BackwardBatch:
    """The buckets of one backward pass, exchanged together: each is compressed as it arrives, and the last one
    issues every bucket's rounds as one collective per kind (every rank queues them in the same order).

    Example:
        >>> import torch
        >>> state = SparseState(compressor="topk", density=0.5)
        >>> params = [torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)]
        >>> state.bind([("a", params[0]), ("b", params[1])])
        >>> batch = BackwardBatch()
        >>> g = [torch.ones(4), torch.full((4,), 2.0)]
        >>> futures = [batch.add(state, g[i], state.plan(g[i], [params[i]]), i == 1) for i in (0, 1)]
        >>> [f.wait().as_dense().tolist() for f in futures], state.step
        ([[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]], 1)
    """

    def __init__(self) -> None:
        # per bucket: its rounds (None once they ran out), its average once they did, the future handed out
        self._buckets: list[tuple[Rounds[Future[Average]] | None, Future[Average] | None, Future[Average]]] = []

    def add(self, state: SparseState, buffer: Tensor, plan: BucketPlan, last: bool) -> Future[Average]:
        """Take one bucket (``last``: the step's last); a future of its :class:`Average`."""
        if not self._buckets:
            state.wire.comm.hold()
        try:
            rounds: Rounds[Future[Average]] | None = bucket_rounds(state, buffer, plan, last=False)
            average: Future[Average] | None = None
            try:
                next(rounds)  # type: ignore[arg-type]  # up to its first round, queued
            except StopIteration as stop:  # a single round
                rounds, average = None, stop.value
            out: Future[Average] = Future()
            self._buckets.append((rounds, average, out))
            if last:
                self._issue(state)
        except BaseException:
            self._abandon(state)
            raise
        return out

    def _issue(self, state: SparseState) -> None:
        buckets, self._buckets = self._buckets, []
        averages = run_together([_rest(rounds, average) for rounds, average, _ in buckets])
        state.wire.comm.release()
        state.close()
        for average, (_, _, out) in zip(averages, buckets, strict=True):
            average.add_done_callback(functools.partial(_deliver, out=out))

    def _abandon(self, state: SparseState) -> None:
        """A bucket failed: drop the queue (it could pair with other collectives elsewhere), close the step."""
        if state.wire.comm.queue.depth:
            state.wire.comm.release(issue=False)
        self._buckets = []
        state.close()


def _rest(rounds: Rounds[Future[Average]] | None, average: Future[Average] | None) -> Rounds[Future[Average]]:
    if rounds is None:
        assert average is not None
        return average
    return (yield from rounds)


def _deliver(average: Future[Average], out: Future[Average]) -> None:
    """Complete ``out`` as the bucket's own future completed."""
    try:
        out.set_result(average.value())
    except Exception as error:
        out.set_exception(error)  # type: ignore[arg-type]  # torch types it as the result
