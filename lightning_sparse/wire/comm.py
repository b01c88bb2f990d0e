"""The collectives the package issues, each counted where it is issued (:class:`Collectives`).

Launches in rounds (:data:`Rounds`) issue them; :func:`run_together` drives several in lock-step."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse.wire.stats import Counters, count_all_gather, count_all_reduce, count_all_to_all

T = TypeVar("T")
#: a launch in rounds: it yields after issuing a round whose result it needs before the next, and
#: returns its result; driven together (:func:`run_together`), every bucket's first rounds leave as one.
Rounds = Generator[None, None, T]


def run(rounds: Rounds[T]) -> T:
    """Drive a launch in rounds to its end, alone."""
    return run_together([rounds])[0]


def run_together(launches: list[Rounds[T]]) -> list[T]:
    """Drive several launches in rounds in lock-step, in order (the same on every rank)."""
    results: list[T] = [None] * len(launches)  # type: ignore[list-item]  # each set before it is returned
    active = list(range(len(launches)))
    while active:
        going = []
        for i in active:
            try:
                next(launches[i])
                going.append(i)
            except StopIteration as stop:
                results[i] = stop.value
        active = going
    return results


@dataclass(frozen=True)
class Issued:
    """A collective in flight: its future, and what it is (for the error that says where an exchange stalled).
    ``queued``: a call inside :meth:`Collectives.coalescing`, whose :meth:`wait` issues the queue if needed and
    copies the call's part of the result, on the waiting thread (and CUDA stream)."""

    future: Future[list[Tensor]]
    what: str
    queued: _Queued | None = None

    def wait(self) -> None:
        """Wait for the collective; its output then holds the result. Raises what it raised."""
        if self.queued is not None:
            self.queued.ready()
        else:
            self.future.wait()


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


def reconfigurable(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is one ``torch.distributed`` did not create (torchft's): its own methods are called then."""
    return group is not None and group not in dist.distributed_c10d._world.pg_map


# The raw collectives: module functions looked up at every call, so a test may replace them.
def all_reduce(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Future[list[Tensor]]:
    """Sum ``tensor`` in place over the group, asynchronously."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()


def all_gather(output: Tensor, tensor: Tensor, group: dist.ProcessGroup | None = None) -> Future[list[Tensor]]:
    """:meth:`Collectives.all_gather`, asynchronously."""
    if reconfigurable(group):
        assert group is not None
        opts = dist.distributed_c10d.AllgatherOptions()
        return group.allgather_into_tensor_coalesced([output], [tensor], opts).get_future()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=True).get_future()


def all_to_all(output: Tensor, tensor: Tensor, group: dist.ProcessGroup | None = None) -> Future[list[Tensor]]:
    """:meth:`Collectives.all_to_all`, asynchronously."""
    return dist.all_to_all_single(output, tensor, group=group, async_op=True).get_future()


@dataclass(frozen=True)
class Collectives:
    """Asynchronous collectives over ``group`` (``world`` processes): each call counts its bytes and ring traffic
    into the given :class:`~lightning_sparse.wire.stats.Counters` and returns what it issued (None at world size
    1). Inside :meth:`coalescing` the calls leave as one collective per kind and dtype (each costs a round trip).

    Example:
        >>> import torch
        >>> from lightning_sparse.wire.stats import Counters
        >>> c = Counters()
        >>> Collectives(group=None, world=1).all_reduce(torch.ones(4), c) is None, c.sent_bytes
        (True, 16)
    """

    group: dist.ProcessGroup | None = None
    world: int = 1
    #: the calls queued inside :meth:`coalescing`, and the count of collectives issued
    queue: _Queue = field(default_factory=lambda: _Queue(), compare=False, repr=False)

    @property
    def issued(self) -> int:
        """Collectives this rank issued through this object so far (a coalesced one counts once)."""
        return self.queue.issued

    @contextmanager
    def coalescing(self) -> Iterator[None]:
        """Queue every collective called inside the block; at its end, issue one collective per kind and
        dtype, in first-call order (the same on every rank). Waiting for a queued call issues the queue
        first; nested blocks issue at the outermost one's end.

        Example:
            >>> comm = Collectives(group=None, world=1)
            >>> with comm.coalescing():
            ...     comm.all_reduce(torch.ones(2)) is None    # one process: nothing is issued
            True
        """
        self.hold()
        try:
            yield
        finally:
            self.release()

    def hold(self) -> None:
        """Enter :meth:`coalescing` (for a block spanning calls: a backward pass's)."""
        self.queue.depth += 1

    def release(self, issue: bool = True) -> None:
        """End a :meth:`hold`: at the outermost, issue what is queued (``issue=False``: drop it, after
        a failure; the dropped calls' futures never complete)."""
        queue = self.queue
        queue.depth -= 1
        if queue.depth == 0:
            if issue:
                queue.flush(self)
            else:
                queue.calls.clear()

    def all_reduce(self, tensor: Tensor, counters: Counters | None = None) -> Issued | None:
        """Sum ``tensor`` in place over the group."""
        return self._issue(count_all_reduce, "all-reduce", tensor, tensor, counters)

    def all_gather(self, output: Tensor, tensor: Tensor, counters: Counters | None = None) -> Issued | None:
        """Concatenate every rank's ``tensor`` (same size on all ranks) into ``output``."""
        return self._issue(count_all_gather, "all-gather", output, tensor, counters)

    def all_to_all(self, output: Tensor, tensor: Tensor, counters: Counters | None = None) -> Issued | None:
        """Send chunk ``j`` of ``tensor`` (split evenly along dim 0) to rank ``j``; chunk ``r`` of
        ``output`` receives rank ``r``'s."""
        return self._issue(count_all_to_all, "all-to-all", output, tensor, counters)

    def _issue(
        self,
        count: Callable[[Counters, int, int], None],
        name: str,
        output: Tensor,
        tensor: Tensor,
        counters: Counters | None,
    ) -> Issued | None:
        nbytes = tensor.numel() * tensor.element_size()
        if counters is not None:
            count(counters, self.world, nbytes)
        if self.world <= 1:
            if name != "all-reduce":
                output.copy_(tensor)  # one process: what it would receive is what it sends
            return None
        what = f"{name} of {nbytes:,} bytes"
        if self.queue.depth:
            return self.queue.put(self, name, output, tensor, what, counters)
        self.queue.count(counters)
        return Issued(_ISSUE[name](output, tensor, self.group), what)


_ISSUE: dict[str, Callable[[Tensor, Tensor, dist.ProcessGroup | None], Future[list[Tensor]]]] = {
    "all-gather": lambda output, tensor, group: all_gather(output, tensor, group),
    "all-to-all": lambda output, tensor, group: all_to_all(output, tensor, group),
    "all-reduce": lambda output, tensor, group: all_reduce(output, group),
}


class _Queued:
    """One call queued by :meth:`Collectives.coalescing`: its part of the coalesced collective, and its future."""

    def __init__(self, queue: _Queue, kind: str, output: Tensor, tensor: Tensor) -> None:
        self.queue = queue
        self.kind = kind
        self.output = output
        self.tensor = tensor
        self.future: Future[list[Tensor]] = Future()
        #: set when issued: the coalesced collective's future, its output and this call's columns there
        self.issued: Future[list[Tensor]] | None = None
        self.merged: Tensor | None = None
        self.columns = slice(0)
        self._copied = False

    def ready(self) -> None:
        if self.issued is None:  # waited for inside the block: issue what is queued
            assert self.queue.comm is not None
            self.queue.flush(self.queue.comm)
        assert self.issued is not None and self.merged is not None
        self.issued.wait()  # raises the collective's error; on CUDA, orders this stream after it
        if self._copied:
            return
        self._copied = True
        if self.kind == "all-reduce":
            self.output.copy_(self.merged[self.columns].view_as(self.output))
        else:  # rows: one per rank (the source of an all-gather's part, of an all-to-all's chunk)
            self.output.view(self.merged.shape[0], -1).copy_(self.merged[:, self.columns])


class _Queue:
    """The calls queued inside :meth:`Collectives.coalescing` (shared by copies of a :class:`Collectives`)."""

    def __init__(self) -> None:
        self.depth = 0
        self.issued = 0
        self.calls: list[_Queued] = []
        self.comm: Collectives | None = None
        #: each coalesced collective's send and receive buffers, by its callers' outputs (a bucket's keep theirs, so
        #: find the same buffers at every step; a group is issued again only once its results were taken)
        self.buffers: dict[tuple[object, ...], tuple[Tensor, Tensor, int]] = {}
        self.flushes = 0

    def count(self, counters: Counters | None) -> None:
        self.issued += 1
        if counters is not None:
            counters.collectives += 1

    def put(
        self, comm: Collectives, kind: str, output: Tensor, tensor: Tensor, what: str, counters: Counters | None
    ) -> Issued:
        self.comm = comm
        key = (kind, tensor.dtype, tensor.device)
        if all((c.kind, c.tensor.dtype, c.tensor.device) != key for c in self.calls):
            self.count(counters)  # the first call of its kind in this batch: the collective it joins
        call = _Queued(self, kind, output, tensor)
        self.calls.append(call)
        return Issued(call.future, what, call)

    def flush(self, comm: Collectives) -> None:
        """Issue the queued calls: one collective per kind, dtype and device, in first-call order."""
        self.comm = comm
        calls, self.calls = self.calls, []
        self.flushes += 1
        for k, (_, _, used) in list(self.buffers.items()):
            if used < self.flushes - _KEEP_FLUSHES:
                del self.buffers[k]
        groups: dict[tuple[str, torch.dtype, torch.device], list[_Queued]] = {}
        for call in calls:
            groups.setdefault((call.kind, call.tensor.dtype, call.tensor.device), []).append(call)
        for (kind, _, _), members in groups.items():
            _issue_merged(kind, members, comm)


#: a coalesced collective's buffers are let go after this many flushes without it
_KEEP_FLUSHES = 16


def _issue_merged(kind: str, calls: list[_Queued], comm: Collectives) -> None:
    """Issue ``calls`` as one collective. What it sends is flat (one bucket's message goes as it did alone); it
    receives into what it sends (an all-reduce) or ``(world, width)``, both made once per group of callers' outputs."""
    queue = comm.queue
    # all-gather: each rank's parts side by side, one row per rank after the collective; all-to-all: chunk j
    # of every call side by side in row j (what goes to rank j); all-reduce: the parts end to end, in place
    height = comm.world if kind == "all-to-all" else 1
    rows: list[Tensor] = []
    widths: list[int] = []
    for c in calls:
        rows.append(c.tensor.reshape(height, -1))
        widths.append(rows[-1].shape[1])
    first, width = rows[0], sum(widths)
    if kind == "all-reduce" and len(rows) == 1:
        merged, output = first.reshape(-1), first.reshape(-1)  # in place
    else:
        parts: list[object] = [kind]
        for c in calls:  # a loop, not a generator: no Python call per caller
            out = c.output
            parts += (out.data_ptr(), out.numel(), out.dtype, out.device)
        key = tuple(parts)
        found = queue.buffers.get(key)
        if found is None:
            # several callers' tensors are joined into a buffer; one caller's goes as it is
            joined = first.new_empty(first.shape[0] * width) if len(rows) > 1 else first.reshape(-1)
            found = (joined, joined if kind == "all-reduce" else first.new_empty(comm.world, width), 0)
        joined, output, _ = found
        queue.buffers[key] = (joined, output, queue.flushes)
        if len(rows) == 1:
            merged = first.reshape(-1)
        else:
            merged = joined
            torch.cat(rows, dim=1, out=joined.view(-1, width))
    future = _ISSUE[kind](output.view(-1), merged, comm.group)
    start = 0
    placeholders = []
    for call, width in zip(calls, widths, strict=True):
        call.issued, call.merged, call.columns = future, output, slice(start, start + width)
        start += width
        placeholders.append(call.future)

    def done(f: Future[list[Tensor]]) -> None:  # on the completing thread: no tensor is touched here
        try:
            f.value()
        except Exception as error:  # the callers' futures fail alike
            for p in placeholders:
                p.set_exception(error)  # type: ignore[arg-type]  # torch types it as the result
            return
        for p in placeholders:
            p.set_result([])

    future.add_done_callback(done)


def completed(value: T) -> Future[T]:
    """A future that already holds ``value``."""
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


def futures(*maybe: Issued | None) -> list[Issued]:
    """The collectives that were issued (world size 1 issues none)."""
    return [f for f in maybe if f is not None]


def wait(issued: Issued | None) -> None:
    """Wait for a collective, if one was issued; a failure raises :class:`CollectiveError`."""
    if issued is not None:
        try:
            issued.wait()
        except Exception as error:
            raise CollectiveError(issued.what, error) from error
