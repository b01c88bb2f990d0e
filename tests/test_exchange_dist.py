"""The exchanges of top-k-type selections on 4 and 8 real gloo processes: all-gather and split.

What every exchange must keep: identical results on every rank, and conservation: what the ranks
took out of their ``p = g + e`` (``p - e_new``) is exactly what was applied, ``W * out`` summed in
rank order, bit for bit with float32 values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import DistPool

pytestmark = pytest.mark.dist

SHAPES = {"a.weight": (60, 70), "a.bias": (60,), "b.weight": (5000,), "c.weight": (64, 80), "c.bias": (9,)}


@pytest.fixture(scope="module")
def dist4():
    pool = DistPool(world_size=4)
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def dist8():
    pool = DistPool(world_size=8)
    yield pool
    pool.stop()


def _gradient(numel: int, rank: int, step: int, same: bool) -> torch.Tensor:
    """Skewed gradients: a few large coordinates in a narrow range, as real gradients have."""
    gen = torch.Generator().manual_seed(1000 * step + (0 if same else rank))
    g = torch.randn(numel, generator=gen)
    g[3048:3175] *= 20.0  # a.weight's largest values all in one block of the split's ownership
    return g


def _exchange_worker(
    rank: int,
    world: int,
    exchange: str,
    compact: bool = True,
    value_dtype: str | None = None,
    same: bool = False,
    nan_rank: int | None = None,
    compressor: str = "topk",
) -> dict[str, Any]:
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    named = [(n, torch.zeros(s, requires_grad=True)) for n, s in SHAPES.items()]
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    state = SparseState(
        compressor=compressor,
        density=0.03,
        min_numel=1000,
        warmup_steps=1,
        seed=3,
        fallback_to_dense=False,
        exchange=exchange,
        compact_indices=compact,
        value_dtype=value_dtype,
    )
    state.bind(named)
    plan = state.plan(torch.zeros(numel), params)
    for step in range(5):
        g = _gradient(numel, rank, step, same)
        if nan_rank == rank and step == 3:
            g[10] = float("nan")
        old = {m.name: state.memory.get(m.name).clone() for m in plan.sparse_members if m.name in state.memory}
        out = communicate(state, g.clone(), params).wait().clone()
        taken = torch.zeros(numel)  # p - e_new: what this rank took out of p
        for m in plan.sparse_members:
            seg = slice(m.offset, m.offset + m.numel)
            p = g[seg] + old[m.name] if m.name in old else g[seg]
            e = state.memory.get(m.name) if m.name in state.memory else torch.zeros(m.numel)
            assert bool(torch.isfinite(e).all()), "residuals stay finite"
            if nan_rank == rank and step == 3 and m.offset == 0:
                assert torch.equal(e, old[m.name]), "a non-finite input leaves its residual as it was"
                continue
            taken[seg] = p - e
        everyone = [torch.empty_like(taken) for _ in range(world)]
        dist.all_gather(everyone, taken)
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out)
        assert all(torch.equal(o, outs[0]) for o in outs[1:]) or not bool(torch.isfinite(out).all()), "ranks differ"
        if nan_rank is not None and step == 3:
            assert not bool(torch.isfinite(out).all()), "a non-finite input makes every rank skip the step"
            assert all(not bool(torch.isfinite(o).all()) for o in outs)
            continue
        in_order = torch.zeros(numel)
        for part in everyone:
            in_order += part
        for m in plan.sparse_members:
            seg = slice(m.offset, m.offset + m.numel)
            if step == 0:  # dense warm-up: everything sent, summed in the all-reduce's own order
                assert torch.equal(taken[seg], g[seg])
                torch.testing.assert_close(out[seg] * world, in_order[seg])
            elif value_dtype is None:
                assert torch.equal(out[seg] * world, in_order[seg]), f"step {step} {m.name}: not conserved"
            else:  # the owner keeps its sum's rounding: conserved up to float32 rounding of that add
                torch.testing.assert_close(out[seg].double() * world, in_order[seg].double(), rtol=0, atol=1e-5)
        for m in plan.dense_members:
            seg = slice(m.offset, m.offset + m.numel)
            mean = torch.stack([_gradient(numel, r, step, same)[seg] for r in range(world)]).mean(0)
            torch.testing.assert_close(out[seg], mean)
    last = state.telemetry.last
    sparse_numel = sum(m.numel for m in plan.sparse_members)
    applied = int((out[[i for m in plan.sparse_members for i in range(m.offset, m.offset + m.numel)]] != 0).sum())
    return {
        "wire": last.wire_bytes,
        "dense_wire": last.dense_wire_bytes,
        "applied": applied,
        "sparse_numel": sparse_numel,
        "k": sum(max(1, round(0.03 * m.numel)) for m in plan.sparse_members),
        "out": out,
        "g": _gradient(numel, rank, 4, same),
        "offsets": [(m.offset, m.numel) for m in plan.sparse_members],
    }


CASES = [
    ("allgather", True, None),
    ("allgather", False, None),
    ("split", True, None),
    ("split", False, None),
    ("split", True, "bfloat16"),
    ("auto", True, None),
]


@pytest.mark.parametrize("exchange,compact,value_dtype", CASES)
def test_exchanges_conserve_and_agree_on_4_ranks(dist4, exchange: str, compact: bool, value_dtype: str | None) -> None:
    results = dist4.run(_exchange_worker, exchange=exchange, compact=compact, value_dtype=value_dtype)
    r = results[0]
    if exchange in ("allgather", "auto"):  # auto: the split would move 3/4 of the bytes, not half
        assert r["applied"] > 2 * r["k"], "the union of every rank's selection is applied"
    else:  # split: a global selection of about k coordinates
        assert r["applied"] <= r["k"] + 4


@pytest.mark.parametrize("exchange", ["allgather", "split"])
def test_exchanges_conserve_and_agree_on_8_ranks(dist8, exchange: str) -> None:
    from lightning_sparse.wire import SPLIT_BLOCK, split_capacities

    # at 8 ranks a.weight alone selects more coordinates in one owner's block than a chunk holds:
    # the smallest of them wait in the residual (conservation still checked exactly)
    assert 3048 % SPLIT_BLOCK == 0
    r = dist8.run(_exchange_worker, exchange=exchange)[0]
    a_weight_k = round(0.03 * 60 * 70)
    assert a_weight_k > split_capacities(r["sparse_numel"], r["k"], 8)[0]


@pytest.mark.parametrize("compressor", ["rtopk", "gaussiank", "dgc"])
def test_split_takes_every_top_k_type_compressor(dist4, compressor: str) -> None:
    dist4.run(_exchange_worker, exchange="split", compressor=compressor)


def test_split_with_a_non_finite_input_on_one_rank(dist4) -> None:
    dist4.run(_exchange_worker, exchange="split", nan_rank=2)


def test_split_of_identical_inputs_applies_the_largest_coordinates(dist4) -> None:
    """Every rank holding the same ``p``: the global selection sums W equal values, so the
    applied values are exactly ``p`` at the chosen coordinates, and those are large ones."""
    results = dist4.run(_exchange_worker, exchange="split", same=True)
    out, g = results[0]["out"], results[0]["g"]
    chosen = out != 0
    assert int(chosen.sum()) > 0
    # the residual carried over from earlier steps makes p differ from g: check the sizes only
    big = g.abs() > 3.0
    assert float(chosen[big].float().mean()) > float(chosen[~big].float().mean())


def _bytes_worker(rank: int, world: int) -> dict[str, float]:
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    named = [("w1", torch.zeros(300, 400, requires_grad=True)), ("w2", torch.zeros(100_000, requires_grad=True))]
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    wire = {}
    for exchange in ("allgather", "split", "auto"):
        for compact in (False, True):
            state = SparseState(
                density=0.01, warmup_steps=1, fallback_to_dense=False, exchange=exchange, compact_indices=compact
            )
            state.bind(named)
            for step in range(2):
                communicate(state, torch.randn(numel, generator=torch.Generator().manual_seed(rank + step)), params)
            wire[f"{exchange}/{compact}"] = state.telemetry.last.wire_bytes
    return wire


def test_split_moves_at_most_0_4_of_allgather_on_8_ranks(dist8) -> None:
    results = dist8.run(_bytes_worker)
    assert all(r == results[0] for r in results[1:])
    w = results[0]
    for compact in (False, True):
        assert w[f"split/{compact}"] <= 0.4 * w[f"allgather/{compact}"], w
        # auto takes the split only from a quarter of the all-gather's bytes (about 16 ranks)
        assert w[f"auto/{compact}"] == w[f"allgather/{compact}"], w
    assert w["split/True"] < w["split/False"] and w["allgather/True"] < w["allgather/False"]
