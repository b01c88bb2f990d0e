"""Update mode's exchange on FSDP2 shards: 4 gloo processes as 2 groups of 2 (sparse HSDP's layout).

Inside a group FSDP2 (``fully_shard`` on the mesh's ``"shard"`` dimension) reduce-scatters the
gradients; each process's own optimizer steps its local shards; the exchange runs on those shards
across the ``"replicate"`` dimension, between the processes that hold the same shard index. The
test checks, every step: the shards with the same index are identical across groups after the
exchange; the global shard moved by the average of what the replicas sent; what each sent has at
most k nonzeros per tensor and, with the new residual, adds up to the old residual plus the
optimizer's update; and the model trains. This is the building block of a sharded front end.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import DistPool, needs_fsdp2

pytestmark = needs_fsdp2


@pytest.fixture(scope="module")
def dist4():
    pool = DistPool(world_size=4)
    yield pool
    pool.stop()


def _shard_worker(rank: int, world: int, steps: int = 10) -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange
    from lightning_sparse.schedules import k_for

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # the same initial model everywhere
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    replicate = mesh["replicate"].get_group()
    # this process's rows of every parameter: to_local() shares the DTensor's storage, so the
    # exchange's in-place writes are what FSDP2 all-gathers at the next forward
    named = [(n, p.to_local()) for n, p in model.named_parameters()]
    density = 0.05
    state = SparseState(
        compressor="topk", density=density, min_numel=256, warmup_steps=0, fallback_to_dense=False, compress="update"
    )
    exchange = UpdateExchange(state)
    exchange.bind(named, process_group=replicate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(10 + rank)  # every process has its own batches
    teacher = torch.Generator().manual_seed(1)
    w_true = torch.randn(16, 4, generator=teacher)
    losses = []
    locals_ = [p for _, p in named]
    for step in range(steps):
        glob = [p.detach().clone() for p in locals_]
        exchange.hold_local()
        e_old = {n: state.memory.get(n).clone() if n in state.memory else torch.zeros(p.numel()) for n, p in named}
        before = [p.detach().clone() for p in locals_]
        x = torch.randn(32, 16, generator=data)
        loss = (model(x) - x @ w_true).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        after = [p.detach().clone() for p in locals_]
        exchange.exchange()
        for (name, p), g, b, a in zip(named, glob, before, after, strict=True):
            e_new = state.memory.get(name) if name in state.memory else torch.zeros(p.numel())
            delta = (a - b).reshape(-1)
            sent = e_old[name] + delta - e_new  # conservation defines it: sent + e_new == e_old + delta
            # the process's view after its step was the global shard plus what it owed
            assert torch.allclose((a - g).reshape(-1), e_old[name] + delta, atol=1e-6), f"{name}: view"
            if p.numel() >= 256:
                assert int((sent != 0).sum()) <= k_for(p.numel(), density), f"{name}: more than k sent"
                assert bool((e_new != 0).any()), f"{name}: a sparse step keeps an unsent part"
            # the global shard moved by the mean of what the replicas sent
            sents = [torch.empty_like(sent) for _ in range(2)]
            dist.all_gather(sents, sent, group=replicate)
            expected = g.reshape(-1) + (sents[0] + sents[1]) / 2
            assert torch.allclose(p.detach().reshape(-1), expected, atol=1e-6), f"{name}: global shard"
            shards = [torch.empty_like(p) for _ in range(2)]
            dist.all_gather(shards, p.detach().contiguous(), group=replicate)
            assert torch.equal(shards[0], shards[1]), f"step {step} {name}: shards differ across groups"
    return {
        "losses": losses,
        "coords": mesh.get_coordinate(),
        "checksum": sum(p.detach().double().sum().item() for p in locals_),
        "shard_numel": sum(p.numel() for p in locals_),
        "sent_bytes": state.telemetry.total.as_dict()["sent_bytes"],
        "dense_bytes": state.telemetry.total.as_dict()["dense_bytes"],
    }


@pytest.mark.dist
def test_update_exchange_on_fsdp2_shards_across_groups(dist4: DistPool) -> None:
    results = dist4.run(_shard_worker, timeout=240)
    by_coords = {tuple(r["coords"]): r for r in results}
    assert sorted(by_coords) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for shard in (0, 1):  # the same shard in both groups, a different one inside a group
        assert by_coords[(0, shard)]["checksum"] == by_coords[(1, shard)]["checksum"]
    assert by_coords[(0, 0)]["checksum"] != by_coords[(0, 1)]["checksum"]
    full = sum(
        p.numel()
        for p in torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
        ).parameters()
    )
    assert by_coords[(0, 0)]["shard_numel"] + by_coords[(0, 1)]["shard_numel"] == full  # each holds half
    for r in results:
        assert r["losses"][-1] < 0.7 * r["losses"][0], r["losses"]
        assert r["sent_bytes"] < r["dense_bytes"]
