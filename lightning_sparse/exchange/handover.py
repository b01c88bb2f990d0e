"""The end-of-fit hand-over of the residuals, and the processes' optimizer states (averaged, or reset)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse._utils import all_reduce_mean_, check_int
from lightning_sparse.wire.comm import wait
from lightning_sparse.wire.stats import FLUSH_METHOD, HAND_OVER, Counters

__all__ = ["average_optimizer_states", "flush_exactly", "flush_in_rounds", "reset_optimizer_states"]


@torch.no_grad()
def flush_exactly(state: Any, params: dict[str, Tensor]) -> None:
    """Add the mean over processes of their residuals to ``params`` and empty them (one float32 all-reduce)."""
    parts = [(state.memory.get(n) if n in state.memory else None, p) for n, p in params.items()]
    flat = torch.cat([e.to(p.device) if e is not None else torch.zeros(p.numel(), device=p.device) for e, p in parts])
    counters = Counters(numel=flat.numel(), buckets=1, dense_buckets=1)
    unsent = torch.count_nonzero(flat).to(torch.float32).reshape(1)  # zero everywhere: no all-reduce
    wait(state.wire.comm.all_reduce(unsent, counters))
    if unsent.item():
        counters.sent_numel = flat.numel()
        wait(state.wire.comm.all_reduce(flat, counters))
        means = flat.div_(state.world_size).split([p.numel() for _, p in parts])
        for (_, p), mean in zip(parts, means, strict=True):
            p.add_(mean.view_as(p).to(p.dtype))
    state.memory.clear()
    state.telemetry.record("unsent parts", counters, FLUSH_METHOD)


@torch.no_grad()
def flush_in_rounds(exchange: Any, rounds: int) -> None:
    """``rounds`` more exchanges of what the processes have not sent, as configured; what is left stays.

    Example:
        >>> flush_in_rounds(None, 0)
        Traceback (most recent call last):
        ...
        ValueError: rounds=0 is not allowed: expected an integer >= 1.
    """
    check_int("rounds", rounds, minimum=1)
    telemetry = exchange.state.telemetry
    exchange.hold_global()
    exchange.due_now, telemetry.label = True, HAND_OVER  # rows of their own in the summary
    try:
        for _ in range(rounds):
            exchange.hold_local()
            exchange.exchange()
            exchange.hold_global()  # an exchange still in flight (sync_delay) arrives here
    finally:
        exchange.due_now, telemetry.label = False, None


@torch.no_grad()
def average_optimizer_states(optimizers: Iterable[Any], group: dist.ProcessGroup | None = None) -> None:
    """Replace every floating tensor of the optimizers' states by its mean over the ranks (same order on all).

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


def reset_optimizer_states(optimizers: Iterable[Any], names: Iterable[str], name_of: Callable[[Any], Any]) -> None:
    """Forget the optimizers' state of the parameters named ``names`` (``name_of``: a parameter's name).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.AdamW([p])
        >>> p.grad = torch.ones(2); opt.step()
        >>> reset_optimizer_states([opt], ["w"], lambda q: "w" if q is p else None); len(opt.state)
        0
    """
    wanted = set(names)
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)
        for group in inner.param_groups:
            for p in group["params"]:
                if name_of(p) in wanted:
                    inner.state.pop(p, None)
