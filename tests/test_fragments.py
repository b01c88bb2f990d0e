"""Fragments (``fragments``, update mode with ``sync_every > 1``): the split, the staggered
exchanges on 2 and 4 real gloo processes (conservation per tensor, one global model, nothing
touched between a fragment's exchanges, lower peak bytes), errors. Exact resume with the Trainer:
tests/test_local_steps_trainer.py (case "fragments")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import DistPool

from lightning_sparse import SparseConfig
from lightning_sparse.exchange.update import split_fragments

SIZES = {"a": 2000, "b": 500, "c": 2000, "d": 500}


@pytest.mark.parametrize("how", ["strided", "contiguous"])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_split_keeps_every_tensor_once_in_module_order(how: str, count: int) -> None:
    sizes = [(f"t{i}", n) for i, n in enumerate([4000, 300, 300, 300, 300, 300, 300, 300, 300, 10])]
    parts = split_fragments(sizes, count, how)
    assert len(parts) == count and all(parts)
    flat = [n for part in parts for n in part]
    assert sorted(flat) == sorted(n for n, _ in sizes)
    order = [n for n, _ in sizes]
    assert all(part == sorted(part, key=order.index) for part in parts)
    if how == "contiguous":
        assert flat == order
    # equal blocks go round robin (strided) or in runs (contiguous)
    blocks = [(f"b{i}", 10) for i in range(8)]
    expected = {"strided": [[f"b{i}" for i in range(f, 8, count)] for f in range(count)]}
    if how in expected and 8 % count == 0:
        assert split_fragments(blocks, count, how) == expected[how]


def _fragments_worker(rank: int, world: int, fragments: int) -> dict[str, Any]:
    from lightning_sparse.exchange.outer import AddAverage
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    gen = torch.Generator().manual_seed(0)
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=gen))) for n, s in SIZES.items()]
    params = dict(named)
    state = SparseState(SparseConfig(density=0.05, min_numel=1000, sync_every=4, fragments=fragments, warmup_steps=0))
    memory = state.memory
    exchange = UpdateExchange(state, outer_step=AddAverage(chosen_scale=1.0))  # the plain average, at 4 too
    exchange.bind(named)
    noise = torch.Generator().manual_seed(100 + rank)

    def residual(n: str) -> torch.Tensor:
        return memory.get(n).clone() if n in memory else torch.zeros(SIZES[n])

    glob = {n: p.detach().clone() for n, p in named}
    e_start = {n: residual(n) for n in SIZES}
    synced_at: dict[str, list[int]] = {n: [] for n in SIZES}
    ok: list[bool] = []
    for step in range(1, 9):
        exchange.hold_local()
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=noise) * 0.01)
        view = {n: p.detach().clone() for n, p in named}
        e_before = {n: residual(n) for n in SIZES}
        exchange.exchange()
        for n, p in named:
            if torch.equal(p.detach(), view[n]):  # not this tensor's exchange: nothing touched
                ok.append(torch.equal(residual(n), e_before[n]))
                continue
            synced_at[n].append(step)
            every = [torch.empty(SIZES[n]) for _ in range(world)]
            dist.all_gather(every, p.detach().clone())
            ok.append(all(torch.equal(every[0], x) for x in every[1:]))  # one global value on every rank
            # what this rank sent: its residual and the cycle's progress, less what it keeps (exactly)
            sent = e_start[n] + (view[n] - (glob[n] + e_start[n])) - residual(n)
            sent_every = [torch.empty_like(sent) for _ in range(world)]
            dist.all_gather(sent_every, sent)
            ok.append(torch.allclose(p.detach() - glob[n], sum(sent_every) / world, rtol=1e-5, atol=1e-6))
            glob[n], e_start[n] = p.detach().clone(), residual(n)
    return {"ok": ok, "synced_at": synced_at, "peak": state.telemetry.peak_step_wire_bytes}


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_fragments_exchange_staggered_and_conserve(dist2: Any, world: int) -> None:
    pool = dist2 if world == 2 else DistPool(world_size=4)
    try:
        whole = pool.run(_fragments_worker, fragments=1)
        split = pool.run(_fragments_worker, fragments=2)
    finally:
        if pool is not dist2:
            pool.stop()
    for r in whole + split:
        assert all(r["ok"])
    assert all(steps == [4, 8] for steps in whole[0]["synced_at"].values())
    # strided: a and d in the first fragment (exchanged at steps 2, 6), b and c in the second (4, 8)
    assert split[0]["synced_at"] == {"a": [2, 6], "b": [4, 8], "c": [4, 8], "d": [2, 6]}
    assert split[0]["peak"] <= 0.75 * whole[0]["peak"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"fragments": 0}, r"fragments=0 is not allowed"),
        ({"fragments": 2}, r"fragments=2 is not allowed with compress='update' and sync_every=1"),
        (
            {"fragments": 2, "sync_every": 4, "compress": "gradient"},
            r"fragments=2 is not allowed with compress='gradient'",
        ),
        ({"fragments": 2, "sync_every": 4, "fragment_split": "layers"}, r"fragment_split='layers' is not allowed"),
        ({"fragment_split": "contiguous"}, r"fragment_split='contiguous' is not allowed with fragments=1"),
    ],
)
def test_bad_fragments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SparseConfig(**kwargs)


def test_more_fragments_than_tensors_are_refused() -> None:
    from lightning_sparse.exchange.fragment import fragments_of
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    params = [(n, torch.nn.Parameter(torch.zeros(4))) for n in ("w", "b", "v")]
    # at setup: the model has fewer tensors than fragments
    exchange = UpdateExchange(SparseState(SparseConfig(sync_every=4, fragments=4)))
    with pytest.raises(ValueError, match=r"fragments=4 is not allowed for a model of 3 trainable parameter tensors"):
        exchange.bind(params)
    # at the first exchange: an optimizer holds fewer than the model
    exchange = UpdateExchange(SparseState(SparseConfig(sync_every=4, fragments=3)))
    exchange.bind(params)
    with pytest.raises(ValueError, match=r"fragments=3 is not allowed for an optimizer of 2 trainable parameter"):
        fragments_of(["w", "b"], exchange._params, exchange.state.config)
