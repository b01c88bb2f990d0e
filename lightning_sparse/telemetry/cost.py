"""What one exchange of one bucket costs on the wire, and how it is sent, from its sizes alone.
Built from the exchange's own pieces, so :func:`exchange_cost` gives the telemetry's ``wire_bytes``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_sparse.config import SparseConfig
from lightning_sparse.wire import (
    GATHER,
    Collectives,
    bucket_wire_bytes,
    quant,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    sparse_pays,
)
from lightning_sparse.wire.context import wire_context

__all__ = ["exchange_collectives", "exchange_cost", "exchange_time"]


def exchange_cost(
    config: SparseConfig,
    numels: Sequence[int],
    world_size: int,
    dtype: torch.dtype = torch.float32,
    step: int | None = None,
) -> tuple[float, str]:
    """Ring-model wire bytes through each rank of one exchange of one bucket, and how it is sent.

    The exchange's decisions apply (``min_numel``, ``warmup_steps``, ``compressor.k_for``, the byte rule of
    ``fallback_to_dense``); a timed fallback is not modelled.

    Args:
        config: the settings.
        numels: the number of elements of each tensor of the bucket.
        world_size: the number of ranks (>= 1).
        dtype: the bucket's dtype (the gradient's, or in update mode the parameters').
        step: the optimizer step of the exchange (None: ``config.warmup_steps``, the first sparse one).

    Returns:
        ``(bytes, how)``: bytes through each rank, small tensors included; ``how`` is ``"dense"``, ``"allgather"``
        or ``"split"`` (gather pattern), or the compressor's pattern (``"shared"``, ``"sketch"``).

    Example:
        >>> from lightning_sparse import SparseConfig, exchange_cost
        >>> config = SparseConfig(compressor="topk", density=0.01)
        >>> exchange_cost(config, [1_000_000, 1000], world_size=8)
        (361816.0, 'allgather')
        >>> exchange_cost(config, [1_000_000, 1000], world_size=64)
        (157059.0, 'split')
        >>> exchange_cost(config, [1000, 1000], world_size=8)  # below min_numel: dense
        (14000.0, 'dense')
        >>> exchange_cost(config, [1_000_000], world_size=8, step=0)  # warm-up
        (7000000.0, 'dense')
    """
    return _exchange(config, numels, world_size, dtype, step)[:2]


def exchange_collectives(
    config: SparseConfig,
    numels: Sequence[int],
    world_size: int,
    dtype: torch.dtype = torch.float32,
    step: int | None = None,
) -> int:
    """How many collectives one exchange of a bucket of ``numels`` issues (arguments as :func:`exchange_cost`).

    Example:
        >>> from lightning_sparse import SparseConfig
        >>> exchange_collectives(SparseConfig(), [1_000_000, 1000], world_size=8)
        2
        >>> exchange_collectives(SparseConfig(value_bits=2), [1_000_000, 1000], world_size=8)
        1
        >>> exchange_collectives(SparseConfig(compressor="countsketch"), [1_000_000, 1000], world_size=8)
        2
    """
    return _exchange(config, numels, world_size, dtype, step)[2]


def exchange_time(
    config: SparseConfig,
    numels: Sequence[int],
    world_size: int,
    bandwidth: float,
    round_trip: float = 0.0,
    dtype: torch.dtype = torch.float32,
    step: int | None = None,
) -> float:
    """Seconds one exchange of a bucket takes on a link of ``bandwidth`` bytes per second and ``round_trip``
    seconds: ``collectives x round_trip + wire bytes / bandwidth`` (other arguments as :func:`exchange_cost`).

    Example:
        >>> from lightning_sparse import SparseConfig
        >>> config = SparseConfig(compressor="topk", density=0.01)
        >>> round(exchange_time(config, [25_000_000], 2, bandwidth=125e6, round_trip=0.05), 3)  # 1 Gbit/s, 50 ms
        0.06
        >>> round(exchange_time(config, [25_000_000], 2, bandwidth=125e6, round_trip=0.05, step=0), 3)  # dense
        0.85
    """
    if not bandwidth > 0:
        raise ValueError(f"bandwidth={bandwidth!r} is not allowed: expected bytes per second > 0.")
    if not round_trip >= 0:
        raise ValueError(f"round_trip={round_trip!r} is not allowed: expected seconds >= 0.")
    wire, _, collectives = _exchange(config, numels, world_size, dtype, step)
    return collectives * round_trip + wire / bandwidth


def _exchange(
    config: SparseConfig, numels: Sequence[int], world_size: int, dtype: torch.dtype, step: int | None
) -> tuple[float, str, int]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not allowed: expected an int >= 1.")
    sizes = [int(n) for n in numels]
    if any(n < 0 for n in sizes):
        raise ValueError(f"numels={list(numels)!r} is not allowed: expected numbers of elements >= 0.")
    step = config.warmup_steps if step is None else step
    itemsize = dtype.itemsize
    dense = ring_all_reduce_bytes(world_size, sum(sizes) * itemsize), "dense", int(world_size > 1)
    sparse = [n for n in sizes if n >= config.min_numel and n > 0]  # as SparseState.plan marks members
    small = sum(sizes) - sum(sparse)
    if not sparse or step < config.warmup_steps:
        return dense
    ctx = wire_context(config, Collectives(None, world_size))
    ks = ctx.compressor.ks_for(tuple(sparse), config.schedule.density(step))
    vdtype = ctx.vdtype(torch.empty(0, dtype=dtype))
    wire = bucket_wire_bytes(ctx, ks, sparse, vdtype.itemsize)
    if ctx.byte_rule and not sparse_pays(wire, world_size, sum(sparse) * itemsize):
        return dense
    pattern = ctx.compressor.pattern
    how = GATHER.exchange_for(ctx, ks, sparse, vdtype.itemsize) if pattern == "gather" else pattern
    # a sparse bucket's tensors below min_numel join the last round: all-reduced, or all-gathered as codes
    gather = ("all-gather", torch.uint8)
    small_call, small_wire = ("all-reduce", dtype), ring_all_reduce_bytes(world_size, small * itemsize)
    bits = ctx.value_bits
    if small and bits is not None and quant.coded_members_pay(world_size, small, bits, itemsize):
        small_call, small_wire = gather, ring_all_gather_bytes(world_size, quant.message_bytes(small, bits))
    # per round, the (kind, dtype) of each call
    rounds = {
        "allgather": [{gather}],
        "split": [{("all-to-all", torch.uint8)}, {gather}],
        "shared": [{("all-reduce", vdtype)}],
    }.get(how, [{("all-reduce", torch.float32)}, {("all-reduce", vdtype)}])  # sketch: tables, then the candidates
    if small:
        rounds[-1].add(small_call)
    return wire + small_wire, how, sum(len(r) for r in rounds) if world_size > 1 else 0
