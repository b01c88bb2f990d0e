"""The byte model: the MLP's tensors in DDP-like buckets, and each configuration's wire bytes per rank
per step from the package's own ring model, bucket by bucket."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.step.worker import model_shape
from lightning_sparse import SparseConfig, SparseState, exchange_collectives, exchange_cost
from lightning_sparse.schedules import k_for
from lightning_sparse.wire import ring_all_reduce_bytes

#: the world sizes of the model rows (any measured one is added)
MODEL_WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DENSE = "dense"
#: column -> the SparseConfig arguments of that configuration (besides compressor and density)
CONFIGS: dict[str, dict[str, Any]] = {
    "allgather int32": {"exchange": "allgather", "compact_indices": False, "fallback_to_dense": False},
    "allgather compact": {"exchange": "allgather", "compact_indices": True, "fallback_to_dense": False},
    "split int32": {"exchange": "split", "compact_indices": False, "fallback_to_dense": False},
    "split compact": {"exchange": "split", "compact_indices": True, "fallback_to_dense": False},
    "auto": {},  # the defaults: exchange="auto", compact indices, the byte fallback
    "auto bf16": {"value_dtype": "bfloat16"},
}
COLUMNS = (DENSE, *CONFIGS)
#: gradients are float32: the dense parts and a dense bucket travel as 4-byte values
GRAD_DTYPE = torch.float32
#: the links of the time table: (name, bytes per second, round trip in seconds); across data centres
#: a round trip costs tens of milliseconds whatever a collective's size
LINKS = (("1 Gbit/s", 125e6, 0.0), ("1 Gbit/s, 50 ms", 125e6, 0.05), ("10 Gbit/s, 50 ms", 1.25e9, 0.05))


@dataclass(frozen=True)
class Bucket:
    """One DDP-like bucket: ``(name, numel)`` of its tensors in buffer order."""

    tensors: tuple[tuple[str, int], ...]

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.tensors)


def mlp_tensors(params: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of the MLP's parameters in model order: weight and bias of each layer."""
    width = model_shape(params, layers)
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        out += [(f"layers.{i}.weight", (width, width)), (f"layers.{i}.bias", (width,))]
    return out


def ddp_buckets(tensors: list[tuple[str, tuple[int, ...]]], cap_bytes: int) -> list[Bucket]:
    """Tensors in reverse order (as DDP fills its buckets during backward), at most ``cap_bytes`` of
    float32 gradient per bucket; a tensor above the cap gets a bucket of its own."""
    buckets: list[Bucket] = []
    current: list[tuple[str, int]] = []
    size = 0
    for name, shape in reversed(tensors):
        numel = math.prod(shape)
        nbytes = numel * GRAD_DTYPE.itemsize
        if current and size + nbytes > cap_bytes:
            buckets.append(Bucket(tuple(current)))
            current, size = [], 0
        current.append((name, numel))
        size += nbytes
    if current:
        buckets.append(Bucket(tuple(current)))
    return buckets


def make_config(config: str, density: float) -> SparseConfig:
    """The settings of one configuration (top-k at ``density``; gradient mode, as the hook alone)."""
    return SparseConfig(compress="gradient", compressor="topk", density=density, **CONFIGS[config])


def make_state(config: str, density: float) -> SparseState:
    """The hook's state of one configuration (top-k at ``density``)."""
    return SparseState(make_config(config, density))


def bucket_wire(config: str, density: float, world: int, bucket: Bucket) -> tuple[float, str]:
    """``(wire bytes per rank, how the bucket is sent)`` of one bucket's sparse step: ``"dense"``,
    ``"allgather"`` or ``"split"`` (:func:`lightning_sparse.exchange_cost` on a float32 bucket)."""
    if config == DENSE:
        return ring_all_reduce_bytes(world, bucket.numel * GRAD_DTYPE.itemsize), "dense"
    numels = [numel for _, numel in bucket.tensors]
    return exchange_cost(make_config(config, density), numels, world, GRAD_DTYPE)


def bucket_collectives(config: str, density: float, world: int, bucket: Bucket) -> int:
    """Collectives one bucket's exchange issues (:func:`lightning_sparse.exchange_collectives`)."""
    if config == DENSE:
        return 1 if world > 1 else 0
    numels = [numel for _, numel in bucket.tensors]
    return exchange_collectives(make_config(config, density), numels, world, GRAD_DTYPE)


def model_row(buckets: list[Bucket], density: float, world: int) -> dict[str, Any]:
    """Every column's wire bytes per rank per step at ``world`` ranks, how each bucket goes, and the
    collectives: were every bucket to issue its own (a comparison), and as the exchange issues them
    in both modes, every bucket's together (as many as the largest bucket's)."""
    row: dict[str, Any] = {"world": world, "bytes": {}, "sent_as": {}, "collectives": {}, "update_collectives": {}}
    for column in COLUMNS:
        figures = [bucket_wire(column, density, world, b) for b in buckets]
        row["bytes"][column] = sum(wire for wire, _ in figures)  # summed in bucket order, as the telemetry
        row["sent_as"][column] = [how for _, how in figures]
        counts = [bucket_collectives(column, density, world, b) for b in buckets]
        row["collectives"][column] = sum(counts)
        row["update_collectives"][column] = max(counts)
    return row


def link_seconds(row: dict[str, Any], column: str, bandwidth: float, round_trip: float, update: bool) -> float:
    """Seconds a step's exchange takes on a link: ``collectives x round trip + wire bytes / bandwidth``."""
    collectives = row["update_collectives" if update else "collectives"][column]
    return collectives * round_trip + row["bytes"][column] / bandwidth


def describe_size(params: int, layers: int, cap_bytes: int, density: float) -> dict[str, Any]:
    tensors = mlp_tensors(params, layers)
    buckets = ddp_buckets(tensors, cap_bytes)
    min_numel = SparseConfig().min_numel
    return {
        "params": sum(b.numel for b in buckets),
        "width": model_shape(params, layers),
        "layers": layers,
        "buckets": [
            {
                "tensors": [name for name, _ in b.tensors],
                "numel": b.numel,
                "sparse_numel": sum(n for _, n in b.tensors if n >= min_numel),
                "k": sum(k_for(n, density) for _, n in b.tensors if n >= min_numel),
            }
            for b in buckets
        ],
    }
