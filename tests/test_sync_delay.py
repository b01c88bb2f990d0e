"""Exchanges in flight (``sync_delay``, update mode with ``sync_every > 1``), on 2 and 4 real gloo
processes: the global values identical on every process at every step, each exchange applied
``sync_delay`` steps after its launch with the mean of what the processes sent (kept exactly apart
from their residuals), the view keeping its own sent part meanwhile; with fragments; the errors.
Exact resume with the Trainer from a checkpoint written while an exchange was in flight:
tests/test_local_steps_trainer.py (case "delayed")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import DistPool

from lightning_sparse import SparseConfig

SIZES = {"a": 2000, "b": 500, "c": 2000, "d": 500}


def _delay_worker(
    rank: int,
    world: int,
    delay: int,
    fragments: int,
    device: str = "cpu",
    offload: bool = False,
    value_bits: int | None = None,
    how: str = "auto",
    outer: str | None = None,
    sizes: dict[str, int] = SIZES,
    min_numel: int = 100,
) -> dict[str, Any]:
    """Twelve steps of random progress at every rank, checked at every step. On ``device`` (the
    parameters, the exchange's buffers; what is checked is copied to the CPU, where gloo compares)."""
    from lightning_sparse.exchange.outer import AddAverage, outer_step_for
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    gen = torch.Generator().manual_seed(0)
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=gen).to(device))) for n, s in sizes.items()]
    config = SparseConfig(
        density=0.05,
        min_numel=min_numel,
        sync_every=4,
        sync_delay=delay,
        fragments=fragments,
        warmup_steps=0,
        value_bits=value_bits,
        offload_global=offload,
        offload_residual=offload,
        exchange=how,
        outer_optimizer=outer,
    )
    state = SparseState(config)
    memory = state.memory
    # the plain average where no outer step is named (the default scales the chosen coordinates above 2)
    plain = AddAverage(chosen_scale=1.0)
    exchange = UpdateExchange(state, outer_step=plain if outer is None else outer_step_for(config.outer_factory))
    exchange.bind(named)
    noise = torch.Generator().manual_seed(100 + rank)

    def residual(n: str) -> torch.Tensor:
        return memory.get(n).to("cpu", copy=True) if n in memory else torch.zeros(sizes[n])

    def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(-1) for n in sizes])

    def same_everywhere(t: torch.Tensor) -> bool:
        every = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(every, t)
        return all(torch.equal(every[0], x) for x in every[1:])

    ok: list[bool] = []
    launched: dict[str, list[int]] = {n: [] for n in sizes}
    applied: dict[str, list[int]] = {n: [] for n in sizes}
    in_flight: dict[str, list[torch.Tensor]] = {n: [] for n in sizes}  # what each launch sent, oldest first
    placed: set[str] = set()  # where the global values lived
    for step in range(1, 13):
        exchange.hold_local()
        with torch.no_grad():
            for _, p in named:
                p.add_((torch.randn(p.shape, generator=noise) * 0.01).to(device))
        view = {n: p.detach().to("cpu", copy=True) for n, p in named}
        glob = {n: exchange._global[n].to("cpu", copy=True) for n in sizes}  # the global values, aside
        e_old = {n: residual(n) for n in sizes}
        exchange.exchange()
        new_glob = {n: exchange._global[n].to("cpu", copy=True) for n in sizes}
        placed.update(str(g.device) + (" pinned" if g.is_pinned() else "") for g in exchange._global.values())
        ok.append(same_everywhere(flat(new_glob)))  # one global model at every step
        # launched at this step: in flight with its whole delay ahead (without a delay: what it sent left the
        # residual; the split exchange settles the residual when its second round arrives, the all-gather at once)
        just = {n for f in exchange._in_flight if f.left == delay for b in f.buckets for n in b.names}
        for n, param in named:
            p = param.detach().cpu()
            arrived = not torch.equal(new_glob[n], glob[n])
            if n in just if delay else not torch.equal(residual(n), e_old[n]):
                launched[n].append(step)
                # the view and global values the launch started from (an arrival at this step comes first)
                start, g = (view[n], glob[n]) if delay == 0 else (p, new_glob[n])
                u = e_old[n] + (start.reshape(-1) - (g.reshape(-1) + e_old[n]))
                in_flight[n].append(u if how == "split" and delay else u - residual(n))
                if delay and not arrived:
                    ok.append(torch.equal(p, view[n]))  # nothing left the view at the launch
            if arrived:  # an exchange of n arrived: the mean of what the processes sent
                applied[n].append(step)
                mine = in_flight[n].pop(0)
                if how == "split" and delay:
                    mine = mine - residual(n)  # settled now
                every = [torch.empty(sizes[n]) for _ in range(world)]
                dist.all_gather(every, mine)
                mean = (sum(every) / world).view_as(glob[n])
                if outer is None:  # the plain outer step adds it; another one steps with it
                    ok.append(torch.allclose(new_glob[n] - glob[n], mean, rtol=1e-5, atol=1e-6))
                if delay:  # the view: the new global values plus all it has not had averaged yet
                    expected = view[n] + (new_glob[n] - glob[n]) - mine.view_as(view[n])
                    ok.append(torch.allclose(p, expected, rtol=1e-5, atol=1e-6))
    exchange.hold_global()  # what is still in flight arrives
    ok.append(same_everywhere(flat({n: p.detach().cpu() for n, p in named})))
    ok.append(all(p.device.type == torch.device(device).type for _, p in named))
    small = state.telemetry.methods.get("dense (small tensors)")
    return {
        "ok": ok,
        "launched": launched,
        "applied": applied,
        "placed": placed,
        "wait": state.telemetry.wait_seconds,
        "coded_bytes": None if small is None else small.sent_bytes,
    }


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_delayed_exchanges_apply_the_mean_later_and_keep_replicas(dist2: Any, world: int) -> None:
    pool = dist2 if world == 2 else DistPool(world_size=4)
    try:
        now = pool.run(_delay_worker, delay=0, fragments=1)
        one = pool.run(_delay_worker, delay=1, fragments=1)
        four = pool.run(_delay_worker, delay=4, fragments=1)
        staggered = pool.run(_delay_worker, delay=1, fragments=2)
        split = pool.run(_delay_worker, delay=2, fragments=2, how="split", value_bits=2)
        nesterov = pool.run(_delay_worker, delay=1, fragments=1, outer="nesterov")
        # a fragment of small tensors only (b and c, below min_numel): coded, not a float all-reduce
        small = pool.run(_delay_worker, delay=1, fragments=2, value_bits=2, sizes={"a": 2000, "b": 60, "c": 60})
    finally:
        if pool is not dist2:
            pool.stop()
    runs = {"now": now, "one": one, "four": four, "staggered": staggered, "split": split, "nesterov": nesterov}
    runs["small"] = small
    for label, results in runs.items():
        for r in results:
            assert all(r["ok"]), (label, [i for i, ok in enumerate(r["ok"]) if not ok], len(r["ok"]))
    for n in SIZES:
        assert now[0]["launched"][n] == now[0]["applied"][n] == [4, 8, 12]
        assert one[0]["launched"][n] == [4, 8, 12] and one[0]["applied"][n] == [5, 9]
        assert four[0]["launched"][n] == [4, 8, 12] and four[0]["applied"][n] == [8, 12]
    # strided fragments: a and d exchanged at steps 2, 6, 10 and applied a step later; b and c at 4, 8, 12
    assert staggered[0]["launched"] == {"a": [2, 6, 10], "b": [4, 8, 12], "c": [4, 8, 12], "d": [2, 6, 10]}
    assert staggered[0]["applied"] == {"a": [3, 7, 11], "b": [5, 9], "c": [5, 9], "d": [3, 7, 11]}
    # the split exchange (two rounds, the second in flight), 2-bit values, two steps later
    assert split[0]["launched"] == staggered[0]["launched"]
    assert split[0]["applied"] == {"a": [4, 8, 12], "b": [6, 10], "c": [6, 10], "d": [4, 8, 12]}
    assert nesterov[0]["applied"] == one[0]["applied"]
    assert small[0]["launched"] == {"a": [2, 6, 10], "b": [4, 8, 12], "c": [4, 8, 12]}
    assert small[0]["coded_bytes"] < 120 * 4 * 3  # three exchanges of b and c, each under a float32 all-reduce


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sync_delay": -1}, r"sync_delay=-1 is not allowed"),
        ({"sync_delay": 1}, r"sync_delay=1 is not allowed with compress='update' and sync_every=1"),
        ({"sync_delay": 5, "sync_every": 4}, r"sync_delay=5 is not allowed .* at most sync_every"),
    ],
)
def test_bad_delays_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SparseConfig(**kwargs)
