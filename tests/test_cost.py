"""exchange_cost: what one exchange of one bucket costs and how it is sent, from sizes alone.

It must answer as the exchange does: the committed figures of the wire-bytes-at-scale page (the
scale benchmark's byte model before it used this function), the ring-model primitives the exchange
decides with, and the telemetry of real exchanges on two processes.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_sparse
from lightning_sparse import SparseConfig, exchange_cost
from lightning_sparse.schedules import k_for
from lightning_sparse.wire import GATHER, bucket_wire_bytes, ring_all_reduce_bytes, sparse_pays
from lightning_sparse.wire.context import wire_context

ROOT = Path(__file__).resolve().parent.parent
SCALE_JSON = ROOT / "docs" / "scale" / "scale.json"


def test_exported() -> None:
    assert "exchange_cost" in lightning_sparse.__all__ and lightning_sparse.exchange_cost is exchange_cost


def test_it_does_not_reach_into_the_hook_or_the_state() -> None:
    tree = ast.parse((ROOT / "lightning_sparse" / "telemetry" / "cost.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"lightning_sparse.exchange.hook", "lightning_sparse.exchange.state"}


# --------------------------------------------------------------------------- the scale page's figures
def _scale_buckets(size: dict[str, Any]) -> list[list[int]]:
    """The numels of each bucket of the scale benchmark's MLP (square layers of ``width``)."""
    width = size["width"]
    return [
        [width * width if name.endswith(".weight") else width for name in bucket["tensors"]]
        for bucket in size["buckets"]
    ]


def test_the_scale_pages_figures() -> None:
    """Every sparse column of docs/scale/scale.json (bytes per rank per step, summed bucket by bucket,
    and how each bucket went) at every modelled world size."""
    figures = json.loads(SCALE_JSON.read_text())
    checked = 0
    for part in ("model", "measure_model"):
        buckets = _scale_buckets(figures[part]["size"])
        assert sum(map(sum, buckets)) == figures[part]["size"]["params"]
        for row in figures[part]["rows"]:
            for column, settings in figures["configs"].items():
                if column == "dense":
                    continue
                config = SparseConfig(compress="gradient", density=figures["density"], **settings)
                costs = [exchange_cost(config, numels, row["world"]) for numels in buckets]
                assert sum(wire for wire, _ in costs) == row["bytes"][column], (part, row["world"], column)
                assert [how for _, how in costs] == row["sent_as"][column], (part, row["world"], column)
                checked += 1
    assert checked >= 60


# --------------------------------------------------------------------------- the byte rule and the exchange
def _previous(config: SparseConfig, numels: list[int], world: int) -> tuple[float, str]:
    """The scale benchmark's own computation before exchange_cost: the hook's byte rule on a float32
    bucket, then ``GATHER.choose``, plus the all-reduce of the members below ``min_numel``."""
    dense = ring_all_reduce_bytes(world, sum(numels) * 4)
    sparse = [n for n in numels if n >= config.min_numel and n > 0]
    small = sum(numels) - sum(sparse)
    if not sparse:
        return dense, "dense"
    ks = [k_for(n, config.schedule.density(config.warmup_steps)) for n in sparse]
    ctx = wire_context(config)  # what the state's wire context holds (its world size is not read)
    vbytes = (config.value_dtype or torch.float32).itemsize  # type: ignore[union-attr]
    wire = bucket_wire_bytes(ctx, ks, sparse, vbytes, world=world)
    if config.byte_rule and not sparse_pays(wire, world, sum(sparse) * 4):
        return dense, "dense"
    how, wire = GATHER.choose(world, sum(ks), vbytes, sum(sparse), config.exchange, config.compact_indices)
    return wire + ring_all_reduce_bytes(world, small * 4), how


SETTINGS = [
    {},
    {"value_dtype": "bfloat16"},
    {"exchange": "allgather", "compact_indices": False, "fallback_to_dense": False},
    {"exchange": "split", "compact_indices": True, "fallback_to_dense": False},
    {"density": 0.3},  # the byte rule sends dense at every world size
    {"density": 0.05, "min_numel": 10_000},
]
BUCKETS = [[1_000_000], [300_000, 1000, 250_000, 10], [5000, 20_000, 512], [1000, 1000], []]


@pytest.mark.parametrize("world", [1, 2, 4, 16, 64, 1024])
@pytest.mark.parametrize("settings", SETTINGS, ids=[json.dumps(s) for s in SETTINGS])
def test_same_as_the_benchmarks_previous_computation(settings: dict[str, Any], world: int) -> None:
    config = SparseConfig(compress="gradient", **settings)
    for numels in BUCKETS:
        assert exchange_cost(config, numels, world) == _previous(config, numels, world), numels


def test_a_tiny_bucket_goes_dense() -> None:
    config = SparseConfig()
    assert exchange_cost(config, [1000, 10], 8) == (ring_all_reduce_bytes(8, 1010 * 4), "dense")
    assert exchange_cost(config, [1000], 8, dtype=torch.bfloat16) == (ring_all_reduce_bytes(8, 2000), "dense")
    assert exchange_cost(config, [], 8) == (0.0, "dense")


def test_world_size_one_is_dense_and_free() -> None:
    for compressor in ("topk", "randomk", "countsketch"):
        assert exchange_cost(SparseConfig(compressor=compressor), [1_000_000, 100], 1) == (0.0, "dense")
    # without the byte rule the exchange sends sparse there too (nothing crosses the wire)
    assert exchange_cost(SparseConfig(fallback_to_dense=False), [1_000_000], 1) == (0.0, "allgather")


def test_warm_up_and_the_schedules_density() -> None:
    config = SparseConfig(density=lightning_sparse.WarmupDensity(0.1, 0.01, steps=10), warmup_steps=2)
    dense = (ring_all_reduce_bytes(4, 4_000_000), "dense")
    assert exchange_cost(config, [1_000_000], 4, step=0) == dense
    assert exchange_cost(config, [1_000_000], 4, step=1) == dense
    assert exchange_cost(config, [1_000_000], 4) == exchange_cost(config, [1_000_000], 4, step=2)
    early, late = exchange_cost(config, [1_000_000], 4, step=2), exchange_cost(config, [1_000_000], 4, step=10)
    assert early[1] == late[1] == "allgather" and late[0] < early[0] < dense[0]


def test_patterns_and_value_bits() -> None:
    assert exchange_cost(SparseConfig(compressor="randomk"), [1_000_000], 8)[1] == "shared"
    assert exchange_cost(SparseConfig(compressor="countsketch"), [1_000_000], 8)[1] == "sketch"
    plain = exchange_cost(SparseConfig(), [1_000_000, 2000], 8)
    coded = exchange_cost(SparseConfig(value_bits=2), [1_000_000, 2000], 8)
    assert coded[1] == plain[1] == "allgather" and coded[0] < plain[0]


@pytest.mark.parametrize("world", [0, -1, 2.0, True])
def test_bad_world_size(world: Any) -> None:
    with pytest.raises(ValueError, match="world_size"):
        exchange_cost(SparseConfig(), [1000], world)


def test_bad_numels() -> None:
    with pytest.raises(ValueError, match="numels"):
        exchange_cost(SparseConfig(), [1000, -1], 2)


# --------------------------------------------------------------------------- against real exchanges
#: how the telemetry names a bucket's sending (the method of its sparse step) -> exchange_cost's name
_SENT_AS = {"topk": "allgather", "topk (split)": "split", "randomk": "shared", "countsketch": "sketch"}

EXCHANGED = [
    {"compressor": "topk", "density": 0.01},
    {"compressor": "topk", "density": 0.01, "value_dtype": "bfloat16"},
    {"compressor": "topk", "density": 0.01, "value_bits": 2},  # the small tensor goes as codes
    {"compressor": "topk", "density": 0.02, "exchange": "split", "compact_indices": False},
    {"compressor": "topk", "density": 0.9, "compact_indices": False},  # the byte rule: dense
    {"compressor": "topk", "density": 0.9, "compact_indices": False, "fallback_to_dense": False},
    {"compressor": "randomk", "density": 0.01},
    {"compressor": "countsketch", "density": 0.01},
]
NUMELS = [6000, 100, 3000]


def _exchange_worker(rank: int, world_size: int, settings: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """Each configuration's sparse step (after its warm-up) of one bucket: the telemetry's wire bytes
    and how it was sent."""
    from lightning_sparse import SparseState
    from lightning_sparse.exchange.hook import communicate

    out = []
    for s in settings:
        params = {f"p{i}": torch.zeros(n, requires_grad=True) for i, n in enumerate(NUMELS)}
        state = SparseState(SparseConfig(compress="gradient", **s))
        state.bind(params.items())
        gen = torch.Generator().manual_seed(rank)
        for _ in range(state.config.warmup_steps + 1):
            communicate(state, torch.randn(sum(NUMELS), generator=gen), list(params.values())).wait()
        methods = [m for m in state.telemetry.methods if m != "dense (warm-up)"]
        assert len(methods) == 1, methods
        how = "dense" if methods[0].startswith("dense") else _SENT_AS[methods[0]]
        out.append((state.telemetry.last.wire_bytes, how))
    return out


@pytest.mark.dist
def test_same_as_the_exchange_on_two_processes(dist2) -> None:
    results = dist2.run(_exchange_worker, settings=EXCHANGED)
    assert results[0] == results[1]
    for settings, measured in zip(EXCHANGED, results[0], strict=True):
        config = SparseConfig(compress="gradient", **settings)
        wire, how = exchange_cost(config, NUMELS, 2)
        assert (wire, how) == (pytest.approx(measured[0], rel=1e-12), measured[1]), settings
