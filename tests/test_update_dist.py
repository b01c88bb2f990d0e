"""Update mode (``compress="update"``) on 2 real gloo processes, with the messages read off the wire.

Each rank runs its own AdamW on its own gradients at ``global + e``; after the step the exchange
sends part of ``u = e + delta``. The test decodes what each rank actually sent and checks, every
step and parameter, bit for bit:
- conservation: sent + new residual == old residual + the optimizer's update (delta);
- the global parameters move by the average of what the ranks sent, identically on every rank;
- between steps the module holds the global parameters, and during a step ``global + e``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_hook_dist import COMPRESSORS_ON_THE_WIRE, _compressor, _decode, _params, capture_collectives


def _update_worker(rank: int, world: int, compressor: Any, value_dtype: str | None, steps: int = 4) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    named = _params(torch.float32)
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    with torch.no_grad():  # the same initial model on every rank
        init = torch.Generator().manual_seed(3)
        for p in params:
            p.copy_(torch.randn(p.shape, generator=init) * 0.1)
    state = SparseState(
        compressor=compressor,
        density=0.02,
        min_numel=1000,
        warmup_steps=1,
        value_dtype=value_dtype,
        fallback_to_dense=False,
        seed=5,
        compress="update",
    )
    exchange = UpdateExchange(state)  # one message: all parameters fit in 25 MB
    exchange.bind(named)
    assert exchange.active
    optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)

    data = torch.Generator().manual_seed(100 + rank)  # every rank has its own data
    sparse_steps = 0
    with capture_collectives() as captured:
        for step in range(steps):
            glob = torch.cat([p.detach().reshape(-1).clone() for p in params])
            plan = state.plan(torch.empty(numel), params)
            old = {m.name: state.memory.get(m.name).clone() for m in plan.members if m.name in state.memory}
            exchange.hold_local()
            before = torch.cat([p.detach().reshape(-1).clone() for p in params])
            for m in plan.members:  # the module holds global + e during the rank's own step
                seg = slice(m.offset, m.offset + m.numel)
                expected = glob[seg] + old[m.name] if m.name in old else glob[seg]
                assert torch.equal(before[seg], expected), f"step {step} {m.name}: not global + e"
            optimizer.zero_grad()
            target = torch.randn(numel, generator=data)
            loss = sum(
                (p.reshape(-1) - target[m.offset : m.offset + m.numel]).pow(2).sum()
                for m, p in zip(plan.members, params, strict=True)
            )
            loss.backward()
            optimizer.step()
            after = torch.cat([p.detach().reshape(-1).clone() for p in params])
            ks = [state.compressor.k_for(m.numel, 0.02) for m in plan.sparse_members]  # the compressor's count
            captured.clear()
            exchange.exchange()
            sent = _decode(captured, state, step, plan, ks, numel, torch.float32)
            sparse_step = step >= state.config.warmup_steps
            sparse_steps += sparse_step
            new_global = torch.cat([p.detach().reshape(-1).clone() for p in params])
            delta = after - before
            for m in plan.members:
                seg = slice(m.offset, m.offset + m.numel)
                new = state.memory.get(m.name) if m.name in state.memory else torch.zeros(m.numel)
                e_old = old.get(m.name, torch.zeros(m.numel))
                # conservation, exactly: sent + e_new == e_old + delta
                assert torch.equal(sent[seg] + new, e_old + delta[seg]), f"step {step} {m.name}: conservation broken"
                if m.sparse and sparse_step:
                    assert int((sent[seg] != 0).sum()) <= state.compressor.k_for(m.numel, 0.02)
                    assert bool((new != 0).any()), "a sparse step keeps an unsent part"
                else:
                    assert not bool((new != 0).any()), "a dense send keeps nothing back"
            # the global parameters move by the average of what the ranks sent
            everyone = [torch.empty_like(sent) for _ in range(world)]
            dist.all_gather(everyone, sent)
            expected = glob + torch.stack(everyone).sum(0) / world
            if sparse_step and state.compressor.pattern == "gather":
                # every rank's (value, index) pairs are added in rank order, straight into the
                # global values (dense members: their all-reduced sum, as above)
                in_order = glob.clone()
                for part in everyone:
                    in_order += part / world
                for m in plan.sparse_members:
                    seg = slice(m.offset, m.offset + m.numel)
                    expected[seg] = in_order[seg]
            if value_dtype is None:
                assert torch.equal(new_global, expected)
            else:
                torch.testing.assert_close(new_global, expected, rtol=1e-2, atol=1e-3)
            replicas = [torch.empty_like(new_global) for _ in range(world)]
            dist.all_gather(replicas, new_global)
            assert torch.equal(replicas[0], replicas[1]), "replicas differ"
    return {"sparse_steps": sparse_steps, "telemetry": state.telemetry.total.as_dict(), "steps": state.step}


CASES = [(c, None) for c in COMPRESSORS_ON_THE_WIRE] + [("topk", "bfloat16"), ("randomk", "float16")]


@pytest.mark.dist
@pytest.mark.parametrize("compressor,value_dtype", CASES)
def test_update_conservation_and_global_average(dist2, compressor: str, value_dtype: str | None) -> None:
    results = dist2.run(_update_worker, compressor=_compressor(compressor), value_dtype=value_dtype)
    for r in results:
        assert r["sparse_steps"] == 3 and r["steps"] == 4
        t = r["telemetry"]
        assert t["buckets"] == 4 and t["dense_buckets"] == 1
        assert t["sent_bytes"] < t["dense_bytes"]


def _leave_local_worker(rank: int, world: int) -> dict[str, Any]:
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    named = _params(torch.float32)
    params = [p for _, p in named]
    state = SparseState(compressor="topk", density=0.02, min_numel=1000, fallback_to_dense=False, compress="update")
    exchange = UpdateExchange(state, bucket_bytes=20_000)  # several messages
    exchange.bind(named)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):  # builds residuals
        exchange.hold_local()
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen))
        exchange.exchange()
    glob = [p.detach().clone() for p in params]
    exchange.hold_local()
    moved = any(not torch.equal(p, g) for p, g in zip(params, glob, strict=True))
    exchange.hold_local()  # a second call changes nothing
    exchange.hold_global()  # e.g. validation in the middle of gradient accumulation
    back = all(torch.equal(p, g) for p, g in zip(params, glob, strict=True))
    return {"moved": moved, "back": back, "messages": state.telemetry.steps}


def _outside_writes_worker(rank: int, world: int) -> dict[str, Any]:
    import warnings

    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    named = _params(torch.float32)
    params = [p for _, p in named]
    state = SparseState(compressor="topk", density=0.02, min_numel=1000, fallback_to_dense=False, compress="update")
    exchange = UpdateExchange(state)
    exchange.bind(named)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        exchange.hold_local()
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen))
        exchange.exchange()
    # a write between steps (a checkpoint restore, a callback) becomes the global value
    with torch.no_grad():
        params[0].mul_(0.5)
    written = params[0].detach().clone()
    exchange.hold_local()
    exchange.hold_global()
    kept = torch.equal(params[0], written)
    # one rank's optimizer blows up: its update is dropped there, the global model stays finite
    exchange.hold_local()
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen))
        if rank == 1:
            params[3].view(-1)[5] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exchange.exchange()
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    return {
        "kept": kept,
        "finite": bool(torch.isfinite(flat).all()),
        "flat": flat,
        "nonfinite": exchange.nonfinite_updates,
        "warned": any("non-finite" in str(w.message) for w in caught),
        "residuals_finite": all(bool(torch.isfinite(state.memory.get(n)).all()) for n in state.memory.names()),
    }


@pytest.mark.dist
def test_writes_between_steps_and_nonfinite_updates(dist2) -> None:
    r0, r1 = dist2.run(_outside_writes_worker)
    assert r0["kept"] and r1["kept"]
    assert r0["finite"] and r1["finite"] and torch.equal(r0["flat"], r1["flat"])
    assert (r0["nonfinite"], r1["nonfinite"]) == (0, 1) and r1["warned"] and not r0["warned"]
    assert r0["residuals_finite"] and r1["residuals_finite"]


@pytest.mark.dist
def test_leave_local_restores_global_exactly(dist2) -> None:
    for r in dist2.run(_leave_local_worker):
        assert r["moved"] and r["back"]
        assert r["messages"] == 3


def test_one_process_is_plain_training() -> None:
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    named = _params(torch.float32)
    exchange = UpdateExchange(SparseState(compress="update"))
    exchange.bind(named)
    assert not exchange.active
    before = [p.detach().clone() for _, p in named]
    exchange.hold_local()
    with torch.no_grad():
        for _, p in named:
            p.add_(1.0)
    exchange.exchange()
    for (_, p), b in zip(named, before, strict=True):
        assert torch.equal(p, b + 1.0)  # untouched: nothing to exchange on one process


def test_arguments() -> None:
    from lightning_sparse import SparseDDPStrategy
    from lightning_sparse.exchange.state import SparseState

    assert SparseDDPStrategy().compress == "update"
    assert SparseDDPStrategy(compress="gradient").update_exchange is None
    with pytest.raises(ValueError, match=r"compress='weights' is not allowed: expected 'update'"):
        SparseDDPStrategy(compress="weights")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"momentum_correction=0.9 is not allowed with compress='update'"):
        SparseDDPStrategy(momentum_correction=0.9)
    SparseDDPStrategy(compress="gradient", momentum_correction=0.9)
    assert SparseState().config.compress == "gradient"


def test_training_advice_names_what_to_change() -> None:
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.strategies.ddp import training_advice

    w = [torch.nn.Parameter(torch.zeros(4))]
    adamw, sgd_m, sgd = torch.optim.AdamW(w), torch.optim.SGD(w, lr=0.1, momentum=0.9), torch.optim.SGD(w, lr=0.1)
    assert training_advice(SparseState(compress="update"), [adamw]) == []
    assert training_advice(SparseState(compress="update"), [sgd_m]) == []
    assert training_advice(SparseState(compress="gradient"), [sgd]) == []
    (advice,) = training_advice(SparseState(compress="gradient"), [adamw])
    assert "compress='gradient' with AdamW" in advice and "Use compress='update'" in advice
    (advice,) = training_advice(SparseState(compress="gradient", compressor="randomblock"), [sgd_m])
    assert "compressor='randomblock' with compress='gradient' and an optimizer momentum" in advice
    # random coordinates train well in update mode (measured): no advice
    assert training_advice(SparseState(compress="update", compressor="randomk"), [sgd_m, adamw]) == []


def test_training_advice_for_batchnorm_models() -> None:
    from lightning_sparse import WarmupDensity
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.strategies.ddp import training_advice

    bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    plain = torch.nn.Linear(4, 4)
    sgd_m = torch.optim.SGD(bn.parameters(), lr=0.1, momentum=0.9)
    local = {"compress": "update", "sync_every": 4, "warmup_steps": 0, "batchnorm_warmup": 0}
    (advice,) = training_advice(SparseState(**local), [sgd_m], bn)
    assert "0.0025 of each step's progress" in advice and "WarmupDensity(start=0.1, end=0.01, steps=40)" in advice
    # the automatic warm-up (batchnorm_warmup, on by default), a density warm-up, a share of 1 % or more, a
    # dense first exchange, or no BatchNorm: no advice
    assert training_advice(SparseState(**{**local, "batchnorm_warmup": 40}), [sgd_m], bn) == []
    warm = WarmupDensity(start=0.1, end=0.01, steps=40)
    assert training_advice(SparseState(**{**local, "density": warm}), [sgd_m], bn) == []
    assert training_advice(SparseState(**{**local, "density": 0.04}), [sgd_m], bn) == []
    assert training_advice(SparseState(**{**local, "warmup_steps": 1}), [sgd_m], bn) == []
    assert training_advice(SparseState(**local), [sgd_m], plain) == []
    # the running statistics left as each process's view gathered them
    stats, drift = training_advice(SparseState(**{**local, "batchnorm_batches": 0}), [sgd_m], bn)
    assert "batchnorm_batches=0" in stats and "Leave batchnorm_batches at its default" in stats
    assert "WarmupDensity" in drift


@pytest.mark.parametrize(
    ("settings", "batchnorm", "warmed"),
    [
        ({"sync_every": 4}, True, True),  # 0.0025 of each step's progress
        ({"density": 0.0025}, True, True),
        ({"sync_every": 4, "value_bits": 2, "warmup_steps": 0}, True, True),
        ({}, True, False),  # the default shares 1 %
        ({"sync_every": 4}, False, False),  # no BatchNorm
        ({"sync_every": 4, "batchnorm_warmup": 0}, True, False),  # turned off
        ({"density": 0.0025, "compress": "gradient"}, True, False),  # gradient mode: no views to drift
    ],
)
def test_batchnorm_models_warm_their_density_up(settings: dict[str, Any], batchnorm: bool, warmed: bool) -> None:
    """A BatchNorm model that shares under 1 % of each step's progress at a constant density gets the
    density warm-up (from 0.1 to its density over ``batchnorm_warmup`` steps) when the exchange binds."""
    from lightning_sparse import WarmupDensity
    from lightning_sparse.config import SparseConfig
    from lightning_sparse.schedules import ConstantDensity
    from lightning_sparse.strategies.core import SparseCore

    norm = torch.nn.BatchNorm1d(4) if batchnorm else torch.nn.LayerNorm(4)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), norm)
    core = SparseCore(SparseConfig(**{"compress": "update", **settings}))
    core.bind(net.named_parameters(), None, 0, 1, torch.device("cpu"), module=net)
    schedule = core.state.schedule
    density = settings.get("density", 0.01)
    if warmed:
        assert isinstance(schedule, WarmupDensity), schedule
        assert (schedule.start, schedule.end, schedule.steps) == (0.1, density, 40)
        assert schedule.density(0) == 0.1 and schedule.density(40) == density
    else:
        assert isinstance(schedule, ConstantDensity) and schedule.density(0) == density
    assert isinstance(core.config.schedule, ConstantDensity)  # the setting stays as given


def _replicas_worker(rank: int, world: int) -> dict[str, Any]:
    from lightning_sparse.config import SparseConfig
    from lightning_sparse.exchange.replicas import Replicas
    from lightning_sparse.strategies.core import SparseCore

    torch.manual_seed(rank)  # each rank its own initial parameters: the replicas start from rank 0's
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    net.register_buffer("seen", torch.full((1,), float(rank)))  # differs per rank until broadcast
    core = SparseCore(SparseConfig(compressor="topk", density=0.5, sync_every=4))
    model = core.wrap(net, None, core.ddp_kwargs)
    assert isinstance(model, Replicas)
    start = [p.detach().clone() for p in net.parameters()]
    core.register_hook(model, rank, world, torch.device("cpu"))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))

    def backward() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        net.seen.fill_(float(rank))
        model(x).square().sum().backward()
        model.gradients_ready(core.state)
        return [p.grad.clone() for p in net.parameters()]

    own = backward()
    for p in net.parameters():  # this rank's own gradient, computed without the wrapper
        p.grad = None
    net(x).square().sum().backward()
    expected = [p.grad.clone() for p in net.parameters()]
    exchange = core.state
    exchange.plain_ddp = True  # the timed fallback's plain DDP step: the gradients are averaged
    try:
        averaged = backward()
    finally:
        exchange.plain_ddp = False
    again = backward()
    return {
        "start": start,
        "own": [torch.equal(g, e) for g, e in zip(own, expected, strict=True)],
        "averaged": averaged,
        "expected": expected,
        "again": [torch.equal(g, e) for g, e in zip(again, expected, strict=True)],
        "seen": float(net.seen),
    }


def test_update_mode_replicas_keep_own_gradients_until_a_plain_ddp_step(dist2) -> None:
    """Update mode builds no DDP: the replicas start from rank 0's parameters, a backward keeps each
    rank's own gradient, a plain DDP step of the timed fallback averages them, and every forward
    starts from rank 0's buffers (as DDP's ``broadcast_buffers``)."""
    r0, r1 = dist2.run(_replicas_worker)
    for p0, p1 in zip(r0["start"], r1["start"], strict=True):
        assert torch.equal(p0, p1)
    for r in (r0, r1):
        assert all(r["own"]) and all(r["again"]), r
        assert r["seen"] == 0.0  # rank 0's buffer, broadcast at each forward
    for a0, a1, e0, e1 in zip(r0["averaged"], r1["averaged"], r0["expected"], r1["expected"], strict=True):
        assert torch.equal(a0, a1) and torch.allclose(a0, (e0 + e1) / 2)
