"""What one exchange of one bucket costs on the wire, and how it is sent, from its sizes alone.

:func:`exchange_cost` answers, without a process group or any tensor, the two questions the
exchange answers for a bucket at run time: does it go dense or sparse (warm-up, ``min_numel``, the
byte rule), and, sparse, how (the gather pattern's all-gather or split, or the compressor's own
pattern), with the ring-model bytes that moves through each rank. It is built from the same pieces
as the exchange (:mod:`lightning_sparse.wire`, :func:`~lightning_sparse.schedules.k_for`), so its
answer is the exchange's; the telemetry's ``wire_bytes`` of that bucket is the same figure.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_sparse.config import SparseConfig
from lightning_sparse.exchange import wire_context
from lightning_sparse.schedules import k_for
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
from lightning_sparse.wire.patterns import coded_members_pay

__all__ = ["exchange_cost"]


def exchange_cost(
    config: SparseConfig,
    numels: Sequence[int],
    world_size: int,
    dtype: torch.dtype = torch.float32,
    step: int | None = None,
) -> tuple[float, str]:
    """Ring-model wire bytes through each rank of one exchange of one bucket, and how it is sent.

    The bucket holds tensors of ``numels`` elements of ``dtype`` (the gradient's, or in update mode
    the parameters'), exchanged among ``world_size`` ranks under ``config`` at optimizer step
    ``step`` (None: the first step after warm-up). The exchange's own decisions apply: tensors
    below ``min_numel`` go dense; before ``warmup_steps``, or with no tensor large enough, the
    whole bucket is all-reduced; each sparse tensor sends ``k_for(numel, density)`` coordinates at
    the schedule's density for ``step``; with the byte rule on (``fallback_to_dense``) the bucket
    goes dense where the sparse exchange would move no fewer bytes than a dense all-reduce of its
    sparse tensors (always at world size 1, where nothing moves). A timed fallback's decisions
    depend on measured times and are not modelled.

    Args:
        config: the settings (compressor, density schedule, ``min_numel``, ``warmup_steps``,
            ``fallback_to_dense``, ``value_dtype``, ``value_bits``, ``exchange``, ``compact_indices``).
        numels: the number of elements of each tensor of the bucket.
        world_size: the number of ranks (>= 1).
        dtype: the bucket's dtype (what a dense all-reduce sends; the values of a sparse exchange
            go in ``value_dtype`` or as ``value_bits`` codes).
        step: the optimizer step of the exchange (None: ``config.warmup_steps``, the first sparse one).

    Returns:
        ``(bytes, how)``: bytes through each rank under the ring model of each collective, the
        small tensors sent beside a sparse exchange included; ``how`` is ``"dense"``, ``"allgather"``
        or ``"split"`` (compressors of the gather pattern: topk, rtopk, gaussiank, dgc), or the
        compressor's pattern (``"shared"``: randomk, randomblock; ``"sketch"``: countsketch).

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
    ks = [k_for(n, density) for n in sparse]
    vbytes = ctx.vdtype(torch.empty(0, dtype=dtype)).itemsize
    wire = bucket_wire_bytes(ctx, ks, sparse, vbytes)
    if ctx.byte_rule and not sparse_pays(wire, world_size, sum(sparse) * itemsize):
        return dense, "dense"
    pattern = ctx.compressor.pattern
    how = GATHER.exchange_for(ctx, ks, sparse, vbytes) if pattern == "gather" else pattern
    return wire + _small_tensors_bytes(ctx, small, itemsize), how


def _small_tensors_bytes(ctx: WireContext, numel: int, itemsize: int) -> float:
    """The tensors below ``min_numel`` of a bucket sent sparse: all-reduced as they are, or, with
    ``value_bits``, all-gathered as codes where that moves fewer bytes (``DensePattern.launch_members``)."""
    world, bits = ctx.world_size, ctx.value_bits
    if numel and bits is not None and coded_members_pay(world, numel, bits, itemsize):
        return ring_all_gather_bytes(world, quant.message_bytes(numel, bits))
    return ring_all_reduce_bytes(world, numel * itemsize)
