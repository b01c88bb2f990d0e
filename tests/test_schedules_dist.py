"""Density schedules through the hook on 2 real gloo processes.

- AdaptiveDensity: every rank uses the same k at every step (read off the wire), the choice is the
  argmax of the exact energy-per-bit of what the ranks actually had, and measured network figures
  agree across ranks;
- the hook state, schedule included, resumes exactly from state_dict;
- a warm-up from a high density goes dense (fallback) exactly at the steps the rule says.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from lightning_sparse.exchange.step import sparse_is_cheaper
from lightning_sparse.strategies.checkpoint import read_rank_states

pytestmark = pytest.mark.dist

SHAPES = {"a.weight": (40, 50), "a.bias": (40,), "b.weight": (3000,), "c.weight": (64, 64), "c.bias": (7,)}
BIG = {"big.weight": (300, 250)}  # 75,000 elements: the histogram estimate, not the exact sort


def _params(shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.zeros(s, requires_grad=True)) for n, s in shapes.items()]


def _gradient(numel: int, rank: int, step: int) -> torch.Tensor:
    """Different on every rank; alternately flat (Gaussian) and spiky (heavy-tailed) by phase."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(numel, generator=g)
    return x**5 if (step // 3) % 2 else x


def _adaptive_worker(rank: int, world: int, big: bool, cost_model: str, steps: int = 10) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_sparse import AdaptiveDensity
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.schedules import k_for
    from lightning_sparse.wire import comm

    shapes = {**SHAPES, **(BIG if big else {})}
    named = _params(shapes)
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    if cost_model == "bits":
        schedule = AdaptiveDensity(cost_model="bits", c0=3e4, min_density=1e-3, max_density=0.25, candidates=24)
    else:
        schedule = AdaptiveDensity(min_density=1e-3, max_density=0.25, candidates=24)  # alpha, beta measured
    from lightning_sparse.wire import MessageLayout

    state = SparseState(compressor="topk", density=schedule, min_numel=1000, warmup_steps=1, seed=3)
    state.bind(named)
    schedule = state.schedule  # the rank's own copy, the one that learns

    sizes: list[int] = []
    gathered_sizes: list[int] = []
    tapped = {"bytes": 0}
    real_gather, real_reduce = comm.all_gather, comm.all_reduce

    def gather(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
        if inp.dtype == torch.uint8:  # a bucket's message (the statistics travel as float32)
            gathered_sizes.append(inp.numel())
        tapped["bytes"] += inp.numel() * inp.element_size()
        return real_gather(out, inp, group)

    def reduce(t: torch.Tensor, group: Any = None) -> Any:
        tapped["bytes"] += t.numel() * t.element_size()
        return real_reduce(t, group)

    comm.all_gather, comm.all_reduce = gather, reduce
    densities, expected, optimal_ratio, chosen_ratio, counted = [], [], [], [], []
    try:
        for step in range(steps):
            g = _gradient(numel, rank, step)
            plan = state.plan(g, params)
            sparse = plan.sparse_members
            # what the ranks really have this step: p = g + e, gathered to compute the exact rule
            p = [g[m.offset : m.offset + m.numel].clone() for m in sparse]
            for m, pm in zip(sparse, p, strict=True):
                if m.name in state.memory:
                    pm += state.memory.get(m.name)
            everyone = [torch.empty(numel) for _ in range(world)]
            flat = torch.zeros(numel)
            for m, pm in zip(sparse, p, strict=True):
                flat[m.offset : m.offset + m.numel] = pm
            dist.all_gather(everyone, flat)
            if step > 0:
                densities.append(state.schedule.density(step))  # what the hook will use now
            gathered_sizes.clear()
            before = tapped["bytes"]
            communicate(state, g.clone(), params, is_last=True).wait()
            # telemetry counts every byte handed to a collective, the statistics' all-gather included
            counted.append((tapped["bytes"] - before, state.telemetry.last.sent_bytes))
            if step > 0:
                ks = [k_for(m.numel, densities[-1]) for m in sparse]
                n = sum(m.numel for m in sparse)
                size = MessageLayout(n, sum(ks), torch.float32, state.config.compact_indices).size
                assert gathered_sizes == [size], "the wire must carry the chosen k"
                sizes.append(gathered_sizes[0])
            # the exact energy per bit of every candidate, from all ranks' p
            row = [0.0] * (len(schedule.grid) + 1)
            for r in range(world):
                for m in sparse:
                    a2 = everyone[r][m.offset : m.offset + m.numel].double().square().sort(descending=True).values
                    cum = a2.cumsum(0)
                    for j, x in enumerate(schedule.grid):
                        row[j] += float(cum[k_for(m.numel, x) - 1])
                    row[-1] += float(cum[-1])
            layout = [(plan.label, tuple(m.numel for m in sparse))]
            expected.append(schedule.choose(layout, [row]))
            ratios = []
            for j, x in enumerate(schedule.grid):
                ks = [k_for(m.numel, x) for m in sparse]
                ratios.append(row[j] / schedule.message_costs(ks, [m.numel for m in sparse])[0])
            optimal_ratio.append(max(ratios))
            chosen_ratio.append(ratios)
    finally:
        comm.all_gather, comm.all_reduce = real_gather, real_reduce
    return {
        "counted": counted,
        "schedule_bytes": state.telemetry.methods["density schedule"].sent_bytes,
        "densities": densities,
        "expected": expected[:-1],  # step t's statistics decide step t + 1
        "wire_sizes": sizes,
        "optimal": optimal_ratio[:-1],
        "ratios": chosen_ratio[:-1],
        "grid": list(schedule.grid),
        "cost": schedule.cost_parameters,
    }


@pytest.mark.parametrize("big", [False, True])
def test_adaptive_same_k_on_every_rank_every_step(dist2, big: bool) -> None:
    r0, r1 = dist2.run(_adaptive_worker, big=big, cost_model="bits")
    assert r0["densities"] == r1["densities"] and r0["wire_sizes"] == r1["wire_sizes"]
    for wire_bytes, counted in r0["counted"]:
        assert wire_bytes == counted
    # one float32 per candidate density plus the total, per bucket, every step
    assert r0["schedule_bytes"] == 10 * 4 * (24 + 1)
    assert len(set(r0["densities"])) >= 2, "the test's gradients must make the choice change"
    if not big:  # exact statistics: exactly the argmax of the exact rule
        assert r0["densities"] == r0["expected"]
    # with the histogram estimate: within a fraction of a percent of the best energy per bit
    for d, ratios, best in zip(r0["densities"], r0["ratios"], r0["optimal"], strict=True):
        assert ratios[r0["grid"].index(d)] >= 0.99 * best


def test_adaptive_measured_network_agrees_across_ranks(dist2) -> None:
    r0, r1 = dist2.run(_adaptive_worker, big=False, cost_model="latency_bandwidth", steps=5)
    assert r0["cost"] == r1["cost"]
    assert r0["cost"]["alpha"] > 0 and r0["cost"]["beta"] > 0
    assert r0["densities"] == r1["densities"] and r0["wire_sizes"] == r1["wire_sizes"]
    assert r0["densities"] == r0["expected"]


def _every_compressor_worker(rank: int, world: int, steps: int = 6) -> dict[str, Any]:
    from lightning_sparse import COMPRESSORS, AdaptiveDensity
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.wire import comm

    named = _params({**SHAPES, **BIG})
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    tapped = {"bytes": 0}
    real_gather, real_reduce = comm.all_gather, comm.all_reduce

    def gather(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
        tapped["bytes"] += inp.numel() * inp.element_size()
        return real_gather(out, inp, group)

    def reduce(t: torch.Tensor, group: Any = None) -> Any:
        tapped["bytes"] += t.numel() * t.element_size()
        return real_reduce(t, group)

    out: dict[str, Any] = {}
    comm.all_gather, comm.all_reduce = gather, reduce
    try:
        for name in sorted(COMPRESSORS):
            schedule = AdaptiveDensity(cost_model="bits", c0=3e4, min_density=1e-3, max_density=0.25)
            state = SparseState(compressor=name, density=schedule, min_numel=1000, seed=3)
            state.bind(named)
            schedule = state.schedule  # the rank's own copy, the one that learns
            densities, counted = [], []
            for step in range(steps):
                before = tapped["bytes"]
                communicate(state, _gradient(numel, rank, step), params).wait()
                counted.append((tapped["bytes"] - before, state.telemetry.last.sent_bytes))
                densities.append(schedule.density(step + 1))
            out[name] = {"densities": densities, "counted": counted, "decided": schedule.state_dict()["decided_step"]}
    finally:
        comm.all_gather, comm.all_reduce = real_gather, real_reduce
    return out


def test_adaptive_with_every_compressor(dist2) -> None:
    # all-gather, shared-coordinate and sketch patterns: every rank observes every sparse tensor,
    # so every rank decides the same density; the statistics' bytes are counted like the rest
    from lightning_sparse import COMPRESSORS

    r0, r1 = dist2.run(_every_compressor_worker)
    assert sorted(r0) == sorted(COMPRESSORS)
    for name in r0:
        assert r0[name]["densities"] == r1[name]["densities"], name
        assert r0[name]["decided"] == 6, f"{name}: the last step's statistics did not arrive"
        for wire_bytes, counted in r0[name]["counted"]:
            assert wire_bytes == counted, name
    # random-k's expected energy k/d ||p||^2 per bit only grows with k: it settles at max_density
    assert r0["randomk"]["densities"][-1] == pytest.approx(0.25)


def _resume_worker(rank: int, world: int, schedule_name: str) -> dict[str, Any]:
    from lightning_sparse import AdaptiveDensity, WarmupDensity
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    def make_state() -> SparseState:
        schedule = (
            AdaptiveDensity(min_density=1e-3, max_density=0.25)  # latency-bandwidth, measured
            if schedule_name == "adaptive"
            else WarmupDensity(0.3, 0.01, steps=6)
        )
        return SparseState(compressor="topk", density=schedule, min_numel=1000, seed=1)

    named = _params(SHAPES)
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)

    def run(state: SparseState, steps: range) -> list[torch.Tensor]:
        return [communicate(state, _gradient(numel, rank, t), params).wait().clone() for t in steps]

    original = make_state()
    original.bind(named)
    run(original, range(5))
    buf = io.BytesIO()
    torch.save(original.state_dict(), buf)  # as a checkpoint does
    reference = run(original, range(5, 10))  # the run that was not interrupted
    resumed = make_state()
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))  # before bind, as on resume
    measured_before = getattr(resumed.schedule, "_measured", None)
    resumed.bind(named)
    assert getattr(resumed.schedule, "_measured", None) == measured_before  # not measured again
    rest = run(resumed, range(5, 10))
    same = all(torch.equal(a, b) for a, b in zip(rest, reference, strict=True))
    return {"same": same, "step": resumed.step}


@pytest.mark.parametrize("schedule_name", ["adaptive", "warmup"])
def test_resume_from_state_dict_continues_exactly(dist2, schedule_name: str) -> None:
    for r in dist2.run(_resume_worker, schedule_name=schedule_name):
        assert r["same"] and r["step"] == 10


def _warmup_fallback_worker(rank: int, world: int) -> dict[str, Any]:
    from lightning_sparse import WarmupDensity
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.schedules import k_for

    named = _params(SHAPES)
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    schedule = WarmupDensity(start=1.0, end=0.01, steps=4, mode="linear")  # 1, .7525, .505, .2575, .01
    # int32 indices: an all-gathered pair costs 8 bytes, so dense is cheaper from density 0.5 at 2 ranks
    # (compact indices cost about 1.3 bits each at density 0.75: such a bucket would stay sparse)
    state = SparseState(compressor="topk", density=schedule, min_numel=1000, warmup_steps=1, compact_indices=False)
    state.bind(named)
    rows = []
    for step in range(6):
        g = _gradient(numel, rank, step)
        plan = state.plan(g, params)
        ks = [k_for(m.numel, schedule.density(step)) for m in plan.sparse_members]
        rule_says_dense = not sparse_is_cheaper(state, g, plan.sparse_members, ks)
        out = communicate(state, g.clone(), params).wait()
        last = state.telemetry.last
        rows.append((rule_says_dense, last.fallback_buckets, last.dense_buckets, last.sent_bytes, out.clone()))
    return {"rows": rows, "dense_bytes": numel * 4}


def test_warmup_from_high_density_falls_back_to_dense_then_goes_sparse(dist2) -> None:
    r0, r1 = dist2.run(_warmup_fallback_worker)
    rows = r0["rows"]
    # step 0: the strategy's dense warm-up; steps 1-2 (density >= 0.5 at 2 ranks): fallback
    assert [row[1] for row in rows] == [0, 1, 1, 0, 0, 0]
    assert [row[2] for row in rows] == [1, 1, 1, 0, 0, 0]
    assert [row[0] for row in rows[1:]] == [True, True, False, False, False]
    for row in rows[:3]:
        assert row[3] == r0["dense_bytes"]  # counted as what it was: a dense all-reduce
    for row in rows[3:]:
        assert row[3] < r0["dense_bytes"]
    for a, b in zip(rows, r1["rows"], strict=True):
        assert torch.equal(a[4], b[4])


# --------------------------------------------------------------------------- through Lightning
# 256 samples, batch 16, 2 ranks: 8 steps per epoch; checkpoint at the end of epoch 1 (step 16).
TRAINER_BASE: dict[str, Any] = {"n": 256, "max_steps": 32, "data_by_step": True}
SCHEDULES: dict[str, dict[str, Any]] = {
    # latency-bandwidth, measured from the process group at start-up, saved in the checkpoint
    "adaptive": {"class_path": "lightning_sparse.AdaptiveDensity", "init_args": {"min_density": 0.002}},
    "adaptive_bits": {
        "class_path": "lightning_sparse.AdaptiveDensity",
        "init_args": {"cost_model": "bits", "c0": 20000, "min_density": 0.002, "max_density": 0.4},
    },
    "warmup": {"class_path": "lightning_sparse.WarmupDensity", "init_args": {"start": 0.6, "end": 0.01, "steps": 24}},
}


@pytest.fixture(scope="module")
def schedule_launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from conftest import run_trainer

    root = tmp_path_factory.mktemp("schedules")
    full = run_trainer(
        {
            **TRAINER_BASE,
            "runs": [
                {
                    "name": f"full_{name}",
                    "strategy": {"density": spec},
                    "ckpt_at_epoch": 1,
                    "ckpt_out": str(root / f"{name}.ckpt"),
                }
                for name, spec in SCHEDULES.items()
            ],
        },
        root / "full",
    )
    resumed = run_trainer(
        {
            **TRAINER_BASE,
            "runs": [
                {"name": f"resumed_{name}", "strategy": {"density": spec}, "ckpt_path": str(root / f"{name}.ckpt")}
                for name, spec in SCHEDULES.items()
            ],
        },
        root / "resumed",
    )
    return {"full": full, "resumed": resumed, "root": root}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_trainer_resume_with_schedule_equals_uninterrupted_run(schedule_launches: dict[str, Any], name: str) -> None:
    full, resumed = schedule_launches["full"][f"full_{name}"], schedule_launches["resumed"][f"resumed_{name}"]
    for rank in range(2):
        a, b = full[rank], resumed[rank]
        assert a["global_step"] == b["global_step"] == 32 and b["hook_step"] == 32
        assert a["sent_numel"][16:] == b["sent_numel"], "the resumed run must send the same k every step"
        for key in a["params"]:
            assert torch.equal(a["params"][key], b["params"][key]), f"rank {rank}: {key} differs after resume"
        assert a["schedule_state"] == b["schedule_state"]
        assert a["train_acc"] > a["initial_acc"] + 0.15
    assert full[0]["sent_numel"] == full[1]["sent_numel"]  # the same k on both ranks, every step
    for key in full[0]["params"]:
        assert torch.equal(full[0]["params"][key], full[1]["params"][key])
    if name == "adaptive_bits":
        assert len(set(full[0]["sent_numel"][1:])) >= 2, "the adaptive choice should move on this task"
    saved = read_rank_states(schedule_launches["root"] / f"{name}.ckpt")[0]["state"]["schedule"]
    if name == "adaptive":
        assert saved["measured"]["alpha"] > 0 and saved["measured"]["world_size"] == 2
