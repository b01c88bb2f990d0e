"""The update exchange's pieces: buckets of parameters, fragments, exchanges in flight, staged averages."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse._utils import all_reduce_mean_
from lightning_sparse.wire import Average

__all__ = [
    "Bucket",
    "InFlight",
    "StagedAverage",
    "average_optimizer_states",
    "drop_nonfinite",
    "split_fragments",
]


class Bucket:
    """Parameters exchanged in one message: their update buffer (float32) and global values (one
    flat tensor in the parameters' dtype; ``globals_[name]`` becomes a view into it)."""

    def __init__(
        self, names: list[str], params: list[Tensor], globals_: dict[str, Tensor], home: torch.device, pin: bool
    ) -> None:
        self.names = names
        self.params = params
        numel = sum(p.numel() for p in params)
        first = params[0]
        self.delta = torch.empty(numel, dtype=torch.float32, device=first.device)
        self.glob = torch.empty(numel, dtype=first.dtype, device=home, pin_memory=pin)
        self._pending: Tensor | None = None
        self.views: list[Tensor] = []
        pos = 0
        for name, p in zip(names, params, strict=True):
            view = self.glob[pos : pos + p.numel()].view(p.shape)
            old = globals_.get(name)
            if old is not None:
                view.copy_(old)  # the rank's view is held in the module: keep the global value
            globals_[name] = view
            self.views.append(view)
            pos += p.numel()

    def pending_buffer(self) -> Tensor:
        """A float32 buffer like :attr:`delta` for what this rank hands over while an exchange is in
        flight (``sync_delay``; made on first use)."""
        if self._pending is None:
            self._pending = torch.empty_like(self.delta)
        return self._pending

    def owns(self, globals_: dict[str, Tensor]) -> bool:
        """Whether the global values of its parameters still live in this bucket."""
        return all(globals_.get(n) is v for n, v in zip(self.names, self.views, strict=True))


class InFlight:
    """An exchange launched and not applied yet: its optimizer group, buckets, futures and the
    optimizer steps left before it is applied."""

    def __init__(self, group: tuple[str, ...], buckets: list[Bucket], futures: list[Future[Average]], left: int):
        self.group = group
        self.buckets = buckets
        self.futures = futures
        self.left = left


def check_fragments(count: int, tensors: int, holder: str) -> None:
    """Refuse more fragments than ``holder`` (a model, an optimizer) has parameter tensors.

    Example:
        >>> check_fragments(4, 6, "a model")
    """
    if count > 1 and 0 < tensors < count:
        raise ValueError(
            f"fragments={count} is not allowed for {holder} of {tensors} trainable parameter tensors: expected at "
            f"most {tensors} (a fragment holds whole tensors)"
        )


def split_fragments(sizes: list[tuple[str, int]], count: int, how: str = "strided") -> list[list[str]]:
    """Split parameter tensors (name, number of elements), in module order, into ``count`` fragments
    of about equal size, each in module order.

    ``"strided"``: each tensor joins the fragment with the fewest elements so far (the first such),
    so equal blocks go round robin; ``"contiguous"``: runs of consecutive tensors, each cut where the
    elements so far pass the next equal share (every fragment keeps at least one tensor).

    Example:
        >>> sizes = [("a", 4), ("b", 4), ("c", 4), ("d", 4)]
        >>> split_fragments(sizes, 2), split_fragments(sizes, 2, "contiguous")
        ([['a', 'c'], ['b', 'd']], [['a', 'b'], ['c', 'd']])
    """
    if how == "strided":
        parts: list[list[str]] = [[] for _ in range(count)]
        totals = [0] * count
        for name, numel in sizes:
            f = totals.index(min(totals))
            parts[f].append(name)
            totals[f] += numel
        return parts
    parts = [[]]
    closed = 0  # elements of the fragments already closed
    current = 0  # elements of the open one
    total = sum(n for _, n in sizes)
    for i, (name, numel) in enumerate(sizes):
        left = len(sizes) - i  # tensors not placed yet, this one included
        unopened = count - len(parts)
        target = (total - closed) / (unopened + 1)  # an equal share of what the open and later ones hold
        if parts[-1] and unopened and (current + numel / 2 > target or left == unopened):
            parts.append([])
            closed += current
            current = 0
        parts[-1].append(name)
        current += numel
    return parts


class StagedAverage:
    """An exchange's average for global values that live off the device (``offload_global``): each
    :meth:`add_to` adds it into a copy of ``out`` on the device, with the same operations as into
    ``out`` itself, and copies the result back, so the bits are those of an exchange without
    offloading; an outer optimizer steps where its parameters are, on the CPU."""

    def __init__(self, average: Average, device: torch.device) -> None:
        self.average = average
        self.device = device

    def add_to(self, out: Tensor) -> Tensor:
        staged = out.to(self.device, copy=True)  # one bucket at a time: bounded on the device
        self.average.add_to(staged)
        out.copy_(staged)
        return out


def drop_nonfinite(parts: list[tuple[str, Tensor, Tensor | None, int]], warn: Callable[[str], None]) -> None:
    """Zero the progress of every parameter of a bucket that is not finite (``parts``: name, its
    progress, residual, offset), with ``warn(name)``: their largest magnitudes in one operator
    (``_foreach_norm`` of order inf: NaN or inf where a value is), then one host read for the
    bucket, not one per parameter.

    Example:
        >>> seg = torch.tensor([1.0, float("nan")])
        >>> drop_nonfinite([("w", seg, None, 0)], print)
        w
        >>> seg
        tensor([0., 0.])
        >>> drop_nonfinite([("empty", torch.empty(0), None, 0)], print)  # nothing to drop
    """
    parts = [part for part in parts if part[1].numel()]  # an empty shard (FSDP2) has no largest value
    if not parts:
        return
    largest = torch.stack(torch._foreach_norm([seg for _, seg, _, _ in parts], math.inf))
    finite = torch.isfinite(largest)
    if bool(finite.all()):
        return
    for (name, seg, _, _), ok in zip(parts, finite.tolist(), strict=True):  # rare: per parameter
        if not ok:
            seg.zero_()
            warn(name)


@torch.no_grad()
def average_optimizer_states(optimizers: Iterable[Any], group: dist.ProcessGroup | None = None) -> None:
    """Replace every floating tensor of the optimizers' states by its mean over the ranks (one
    all-reduce per optimizer, in parameter order, the same on every rank).

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
        >>> average_optimizer_states([opt])  # one process: nothing to average
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return
    world = dist.get_world_size(group)
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)
        tensors = [
            value
            for g in inner.param_groups
            for p in g["params"]
            for _, value in sorted(inner.state.get(p, {}).items())
            if isinstance(value, Tensor) and value.is_floating_point()
        ]
        all_reduce_mean_(tensors, group, world, torch.float64)
