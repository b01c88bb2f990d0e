"""Local steps (``sync_every``) and outer optimizers in update mode, on 2 real gloo processes:
between exchanges the rank's view stays in the module and nothing is computed; at an exchange the
cycle's progress and the residual are sent (what is kept, exactly the rest) and the average goes
through the outer step; validation in the middle of a cycle folds the progress into the residual;
with density 1 and the Nesterov outer step this is DiLoCo, checked against a reference loop
written with plain collectives."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_sparse import SparseConfig, SparseDDPStrategy

SHAPES = {"w": (60, 50), "b": (500,)}


def _model() -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    return [(n, torch.nn.Parameter(torch.randn(s, generator=gen))) for n, s in SHAPES.items()]


def _local_steps_worker(
    rank: int, world: int, outer: str | None, bits: int | None, decay: float = 1.0
) -> dict[str, Any]:
    from lightning_sparse.exchange.outer import outer_step_for
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    named = _model()
    params = [p for _, p in named]
    config = SparseConfig(
        density=0.05, min_numel=1000, sync_every=3, outer_optimizer=outer, value_bits=bits, error_feedback_decay=decay
    )
    state = SparseState(config)
    memory = state.memory
    exchange = UpdateExchange(state, outer_step=outer_step_for(config.outer_factory))
    exchange.bind(named)
    gen = torch.Generator().manual_seed(100 + rank)

    def residuals() -> dict[str, torch.Tensor]:
        return {n: memory.get(n).clone() if n in memory else torch.zeros(p.numel()) for n, p in named}

    def flat(tensors: Any) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    untouched, kept, moved_by_mean, folded = [], [], [], []
    glob = [p.detach().clone() for p in params]  # the module holds the global model at the start
    e_start = residuals()
    for step in range(7):
        exchange.hold_local()
        if step % 3 == 0:  # a cycle starts: the view is global + residual, exactly
            assert all(
                torch.equal(p.detach().reshape(-1), g.reshape(-1) + e_start[n])
                for (n, p), g in zip(named, glob, strict=True)
            )
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        view = [p.detach().clone() for p in params]
        e_before = residuals()
        exchange.exchange()
        if step % 3 != 2:  # a step between exchanges: nothing touched, the view stays in the module
            same = all(torch.equal(p.detach(), v) for p, v in zip(params, view, strict=True))
            untouched.append(same and all(torch.equal(e_before[n], memory.get(n)) for n in e_before if n in memory))
            if step == 4:  # validation in the middle of a cycle: the progress is folded, the global model held
                e_mid = residuals()
                exchange.hold_global()
                progress = {
                    n: v.reshape(-1) - (g.reshape(-1) + e_mid[n])
                    for (n, _), v, g in zip(named, view, glob, strict=True)
                }
                folded.append(all(torch.equal(p.detach(), g) for p, g in zip(params, glob, strict=True)))
                folded.append(all(torch.equal(memory.get(n), e_mid[n] + progress[n]) for n in SHAPES))
                e_start = residuals()  # the view is now global + this residual
                view = [g + e_start[n].view_as(g) for (n, _), g in zip(named, glob, strict=True)]
            continue
        after = [p.detach().clone() for p in params]
        every = [torch.empty(sum(p.numel() for p in params)) for _ in range(world)]
        dist.all_gather(every, flat(after))
        kept.append(all(torch.equal(every[0], x) for x in every[1:]))  # one global model on every rank
        # what this rank sent: the cycle's progress and the old residual (decayed), less what it keeps
        e_new = residuals()
        sent = flat(
            decay * e_start[n] + (v.reshape(-1) - (g.reshape(-1) + e_start[n])) - e_new[n]
            for (n, _), v, g in zip(named, view, glob, strict=True)
        )
        if outer is None:
            sent_every = [torch.empty_like(sent) for _ in range(world)]
            dist.all_gather(sent_every, sent)
            mean = sum(sent_every) / world
            moved_by_mean.append(torch.allclose(flat(after) - flat(glob), mean, rtol=1e-5, atol=1e-6))
        glob, e_start = after, e_new
    t = state.telemetry
    return {
        "untouched": untouched,
        "kept": kept,
        "moved_by_mean": moved_by_mean,
        "folded": folded,
        "hook_steps": state.step,
        "telemetry_steps": t.steps,
        "dense_bytes": t.total.dense_bytes,
        "sent_bytes": t.total.sent_bytes,
        "local": t.methods["local step"].dense_bytes,
        "outer": exchange.outer_step.state_dict(),
    }


@pytest.mark.dist
@pytest.mark.parametrize(
    "outer,bits,decay", [(None, None, 1.0), ("nesterov", None, 1.0), ("nesterov", 2, 1.0), (None, None, 0.5)]
)
def test_local_steps_keep_the_view_and_conserve_progress(
    dist2, outer: str | None, bits: int | None, decay: float
) -> None:
    """With ``error_feedback_decay`` (SparseLoCo's decayed error feedback) what is sent and kept adds up
    to the cycle's progress and the decayed residual: ``sent + e_new == decay * e_old + delta``."""
    results = dist2.run(_local_steps_worker, outer=outer, bits=bits, decay=decay)
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    for r in results:
        assert r["untouched"] == [True] * 5  # steps between exchanges compute nothing
        assert r["kept"] == [True] * 2  # steps 3 and 6 exchange (step 3 is the dense warm-up)
        assert r["moved_by_mean"] == ([True] * 2 if outer is None else [])
        assert r["folded"] == [True, True]
        assert r["hook_steps"] == 2 and r["telemetry_steps"] == 7
        assert r["dense_bytes"] == 7 * 4 * numel  # dense DDP would have moved every step's gradients
        assert r["local"] == 5 * 4 * numel
    if outer == "nesterov":
        a, b = results[0]["outer"], results[1]["outer"]
        assert a.keys() == b.keys() and len(a) == 1
        (key,) = a
        buf = [r["outer"][key]["state"][0]["momentum_buffer"] for r in results]
        assert torch.equal(buf[0], buf[1]) and bool(buf[0].abs().sum() > 0)  # the same outer momentum


def _diloco_worker(rank: int, world: int, h: int, rounds: int) -> dict[str, Any]:
    """The library (density 1, Nesterov outer step, sync_every=h) against DiLoCo written out."""
    from lightning_sparse.exchange.outer import outer_step_for
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(10_000 * rank + step)
        x = torch.randn(16, 50, generator=gen)
        return x, x @ torch.linspace(-1, 1, 50 * 3).reshape(50, 3) + 0.1 * torch.randn(16, 3, generator=gen)

    def train(exchange: Any, model: torch.nn.Module, step_hook: Any) -> torch.Tensor:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(h * rounds):
            if exchange is not None:
                exchange.hold_local()
            x, y = batch(step)
            inner.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()
            step_hook(step)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    torch.manual_seed(0)
    ours = torch.nn.Linear(50, 3)
    torch.manual_seed(0)
    ref = torch.nn.Linear(50, 3)
    config = SparseConfig(density=1.0, min_numel=0, sync_every=h, outer_optimizer="nesterov")
    state = SparseState(config)
    exchange = UpdateExchange(state, outer_step=outer_step_for(config.outer_factory))
    exchange.bind(ours.named_parameters())
    mine = train(exchange, ours, lambda step: exchange.exchange())

    # DiLoCo: H inner steps from the global model, outer gradient = global - mean(local), Nesterov SGD
    global_params = [p.detach().clone() for p in ref.parameters()]
    outer_params = [torch.nn.Parameter(g.clone()) for g in global_params]
    outer = torch.optim.SGD(outer_params, lr=0.7, momentum=0.9, nesterov=True)

    def sync(step: int) -> None:
        if (step + 1) % h:
            return
        with torch.no_grad():
            for p, o in zip(ref.parameters(), outer_params, strict=True):
                pseudo = o.detach() - p.detach()
                dist.all_reduce(pseudo)
                o.grad = pseudo / world
            outer.step()
            for p, o in zip(ref.parameters(), outer_params, strict=True):
                p.copy_(o)

    theirs = train(None, ref, sync)
    return {"ours": mine, "theirs": theirs, "start": torch.cat([g.reshape(-1) for g in global_params])}


@pytest.mark.dist
def test_sync_every_with_nesterov_at_density_1_is_diloco(dist2) -> None:
    results = dist2.run(_diloco_worker, h=4, rounds=5)
    for r in results:
        assert not torch.equal(r["ours"], r["start"])
        torch.testing.assert_close(r["ours"], r["theirs"], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0]["ours"], results[1]["ours"])


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"sync_every": 0}, r"sync_every=0 is not allowed: expected an integer >= 1"),
        ({"sync_every": 2.5}, r"sync_every=2.5 is not allowed: expected an integer"),
        ({"sync_every": 4, "compress": "gradient"}, r"sync_every=4 is not allowed with compress='gradient'"),
        ({"outer_optimizer": "adam"}, r"outer_optimizer='adam' is not allowed: expected None"),
        ({"outer_optimizer": len}, r"outer_optimizer=<built-in function len> is not allowed: .*made a int"),
        ({"outer_optimizer": torch.nn.Linear}, r"outer_optimizer=<class 'torch.nn.modules.linear.Linear'> is not"),
        ({"outer_optimizer": "nesterov", "compress": "gradient"}, r"is not allowed with compress='gradient'"),
    ],
)
def test_bad_local_step_arguments_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SparseDDPStrategy(**settings)


def test_outer_optimizer_accepts_classes_and_factories() -> None:
    for value in (torch.optim.SGD, functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)):
        config = SparseConfig(outer_optimizer=value)
        assert config.outer_factory is value
    assert "SGD(lr=0.7, momentum=0.9, nesterov=True)" in str(
        SparseConfig(
            outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        ).fingerprint()
    )


def _no_warmup_worker(rank: int, world: int) -> dict[str, Any]:
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    named = _model()
    state = SparseState(SparseConfig(density=0.05, min_numel=1000, warmup_steps=0, sync_every=2))
    exchange = UpdateExchange(state)
    exchange.bind(named)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        exchange.hold_local()
        with torch.no_grad():
            for _, p in named:
                p.add_(torch.randn(p.shape, generator=gen))
        exchange.exchange()
    return {k: v.buckets for k, v in state.telemetry.methods.items()}


@pytest.mark.dist
def test_update_mode_may_skip_the_dense_warm_up(dist2) -> None:
    # update mode's messages are its own (not DDP's buckets): its first exchange may be sparse
    for methods in dist2.run(_no_warmup_worker):
        assert methods.get("topk") == 1 and "dense (warm-up)" not in methods
