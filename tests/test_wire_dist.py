"""Wire bytes on 4 real gloo processes: the ring model applied to what each collective was handed.

At 2 ranks an all-gather and an all-reduce both move about one message through each rank, so the
traffic ratio equals the message ratio; at 4 they part: an all-gather of ``m`` bytes per rank moves
``3*m`` through each rank, an all-reduce of ``n`` bytes ``1.5*n``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import DistPool
from test_hook_dist import capture_collectives

pytestmark = pytest.mark.dist

SHAPES = {"a.weight": (40, 50), "a.bias": (40,), "b.weight": (3000,), "c.weight": (64, 64), "c.bias": (7,)}
DENSITY = 0.02
STEPS = 4  # step 0 is the dense warm-up


@pytest.fixture(scope="module")
def dist4():
    """Four processes in a gloo process group, for this module only."""
    pool = DistPool(world_size=4)
    yield pool
    pool.stop()


def _ring_bytes(kind: str, world: int, nbytes: int) -> float:
    """The ring model, written out here independently of the package (an all-to-all sends every
    chunk but the rank's own)."""
    if kind == "alltoall":
        return (world - 1) / world * nbytes
    return (world - 1) * nbytes if kind == "gather" else 2 * (world - 1) / world * nbytes


def _wire_worker(rank: int, world: int, case: str) -> dict[str, Any]:
    from lightning_sparse import AdaptiveDensity
    from lightning_sparse.compressors import CountSketch
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.schedules import k_for
    from lightning_sparse.wire import PATTERNS

    named = [(n, torch.zeros(s, requires_grad=True)) for n, s in SHAPES.items()]
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    compressor: Any = CountSketch(rows=3, width=4.0) if case == "countsketch" else case
    exchange = "allgather"
    if case == "split":  # top-k through the split exchange: an all-to-all, then an all-gather
        compressor, exchange = "topk", "split"
    density: Any = DENSITY
    if case == "adaptive":  # top-k whose density schedule all-gathers its statistics every step
        compressor = "topk"
        density = AdaptiveDensity(cost_model="bits", c0=3e4, min_density=1e-3, max_density=0.25, candidates=8)
    state = SparseState(
        compressor=compressor,
        density=density,
        min_numel=1000,
        warmup_steps=1,
        seed=5,
        fallback_to_dense=False,
        exchange=exchange,
    )
    state.bind(named)
    gen = torch.Generator().manual_seed(10 + rank)
    steps = []
    with capture_collectives() as captured:
        for step in range(STEPS):
            captured.clear()
            g = torch.randn(numel, generator=gen)
            plan = state.plan(g, params)
            communicate(state, g, params, is_last=True).wait()
            handed = [(kind, inp.numel() * inp.element_size()) for kind, inp, _ in captured]
            last = state.telemetry.last
            row = {
                "handed": sum(n for _, n in handed),
                "ring": sum(_ring_bytes(kind, world, n) for kind, n in handed),
                "sent": last.sent_bytes,
                "wire": last.wire_bytes,
                "dense": last.dense_bytes,
                "dense_wire": last.dense_wire_bytes,
                "model": None,
            }
            if step >= 1 and case != "adaptive":
                # the pattern's modelled size (what the byte fallback and the adaptive density compare)
                # plus the all-reduce of the bucket's small tensors
                sparse = plan.sparse_members
                ks = [k_for(m.numel, DENSITY) for m in sparse]
                model = PATTERNS[state.compressor.pattern].wire_bytes(
                    world,
                    ks,
                    4,
                    [m.numel for m in sparse],
                    state.compressor,
                    state.config.exchange,
                    state.config.compact_indices,
                )
                row["model"] = model + _ring_bytes("reduce", world, 4 * sum(m.numel for m in plan.dense_members))
            steps.append(row)
    methods = {name: (c.compression_ratio, c.message_ratio) for name, c in state.telemetry.methods.items()}
    return {"steps": steps, "methods": methods, "numel": numel}


@pytest.mark.parametrize("case", ["topk", "split", "randomk", "countsketch", "adaptive"])
def test_wire_bytes_are_the_ring_model_of_what_was_handed_to_each_collective(dist4, case: str) -> None:
    results = dist4.run(_wire_worker, case=case)
    for r in results:
        dense = 4 * r["numel"]
        for s, row in enumerate(r["steps"]):
            assert row["sent"] == row["handed"], s
            assert row["wire"] == pytest.approx(row["ring"], rel=1e-12), s
            assert row["dense"] == dense and row["dense_wire"] == pytest.approx(1.5 * dense, rel=1e-12)
            if row["model"] is not None:
                assert row["wire"] == pytest.approx(row["model"], rel=1e-12), s
        # the warm-up step: the whole bucket all-reduced, and an adaptive density's statistics all-gathered
        warmup = r["steps"][0]
        statistics = warmup["sent"] - dense
        assert (statistics > 0) == (case == "adaptive")
        assert warmup["wire"] == pytest.approx(1.5 * dense + 3 * statistics, rel=1e-12)
    assert [r["steps"] for r in results[1:]] == [results[0]["steps"]] * 3  # same bytes on every rank
    ratio, message = results[0]["methods"][{"adaptive": "topk", "split": "topk (split)"}.get(case, case)]
    if case in ("topk", "adaptive"):
        # all-gathered pairs: each rank's message crosses 3 links, a dense bucket 1.5 of its size;
        # the small dense tensors (all-reduced alike) keep the ratio a little above half
        assert 0.5 < ratio / message < 0.55
    elif case == "split":
        # an all-to-all sends 3 of its 4 chunks, an all-gather's message crosses 3 links: with chunks
        # of twice the global selection's share, ratio / message is about (4*2 + 1) / (2 * (2 + 1))
        assert 1.3 < ratio / message < 1.6
    else:  # only all-reduces: the traffic ratio is the message ratio
        assert ratio == pytest.approx(message, rel=1e-12)
    if case == "topk":  # (value, compact index) pairs of about 5.1 bytes: the message looks 33x smaller
        assert message > 30 and ratio < 19
