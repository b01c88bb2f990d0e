"""What one exchange of one bucket costs on the wire, and how it is sent, from its sizes alone.

Built from the exchange's own pieces, so :func:`exchange_cost` gives the telemetry's ``wire_bytes``;
:func:`exchange_time` adds a round trip per collective (:func:`exchange_collectives`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_sparse.config import SparseConfig
from lightning_sparse.wire import (
    GATHER,
    Collectives,
    WireContext,
    bucket_wire_bytes,
    quant,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    sparse_pays,
)
from lightning_sparse.wire.context import wire_context
from lightning_sparse.wire.quant import coded_members_pay

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
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not allowed: expected an int >= 1.")
    sizes = [int(n) for n in numels]
    if any(n < 0 for n in sizes):
        raise ValueError(f"numels={list(numels)!r} is not allowed: expected numbers of elements >= 0.")
    step = config.warmup_steps if step is None else step
    itemsize = dtype.itemsize
    dense = ring_all_reduce_bytes(world_size, sum(sizes) * itemsize)
    sparse = [n for n in sizes if n >= config.min_numel and n > 0]  # as SparseState.plan marks members
    small = sum(sizes) - sum(sparse)
    if not sparse or step < config.warmup_steps:
        return dense, "dense"
    ctx = wire_context(config, Collectives(None, world_size))
    density = config.schedule.density(step)
    ks = ctx.compressor.ks_for(tuple(sparse), density)
    vbytes = ctx.vdtype(torch.empty(0, dtype=dtype)).itemsize
    wire = bucket_wire_bytes(ctx, ks, sparse, vbytes)
    if ctx.byte_rule and not sparse_pays(wire, world_size, sum(sparse) * itemsize):
        return dense, "dense"
    pattern = ctx.compressor.pattern
    how = GATHER.exchange_for(ctx, ks, sparse, vbytes) if pattern == "gather" else pattern
    return wire + _small_tensors_bytes(ctx, small, itemsize), how


def _small_tensors_bytes(ctx: WireContext, numel: int, itemsize: int) -> float:
    """Bytes of a sparse bucket's tensors below ``min_numel``: all-reduced, or all-gathered as codes."""
    world, bits = ctx.world_size, ctx.value_bits
    if numel and bits is not None and coded_members_pay(world, numel, bits, itemsize):
        return ring_all_gather_bytes(world, quant.message_bytes(numel, bits))
    return ring_all_reduce_bytes(world, numel * itemsize)


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
    return _collectives(config, numels, world_size, dtype, exchange_cost(config, numels, world_size, dtype, step)[1])


def _collectives(config: SparseConfig, numels: Sequence[int], world_size: int, dtype: torch.dtype, how: str) -> int:
    """:func:`exchange_collectives` of an exchange sent as ``how`` (what :func:`exchange_cost` answered)."""
    if world_size <= 1:
        return 0
    if how == "dense":
        return 1
    sizes = [int(n) for n in numels]
    small = sum(n for n in sizes if n < config.min_numel or n == 0)
    ctx = wire_context(config, Collectives(None, world_size))
    vdtype = ctx.vdtype(torch.empty(0, dtype=dtype))
    coded_small = (
        bool(small)
        and ctx.value_bits is not None
        and coded_members_pay(world_size, small, ctx.value_bits, dtype.itemsize)
    )
    # per round, the (kind, dtype) of each call; the small tensors join the pattern's last round
    rounds: list[set[tuple[str, torch.dtype]]]
    if how == "allgather":
        rounds = [{("all-gather", torch.uint8)}]
    elif how == "split":
        rounds = [{("all-to-all", torch.uint8)}, {("all-gather", torch.uint8)}]
    elif how == "shared":
        rounds = [{("all-reduce", vdtype)}]
    else:  # sketch: the tables (float32), then the exact values at the candidates
        rounds = [{("all-reduce", torch.float32)}, {("all-reduce", vdtype)}]
    if small:
        rounds[-1].add(("all-gather", torch.uint8) if coded_small else ("all-reduce", dtype))
    return sum(len(r) for r in rounds)


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
    wire, how = exchange_cost(config, numels, world_size, dtype, step)
    return _collectives(config, numels, world_size, dtype, how) * round_trip + wire / bandwidth
