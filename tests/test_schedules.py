"""Density schedules on plain values and tensors (no processes): values, validation, state, the rule."""

from __future__ import annotations

import dataclasses
import io
import math
import pickle

import pytest
import torch

from lightning_sparse import AdaptiveDensity, ConstantDensity, SparseDDPStrategy, WarmupDensity
from lightning_sparse.exchange.state import Member, SparseState
from lightning_sparse.exchange.step import bucket, sparse_is_cheaper
from lightning_sparse.schedules import as_schedule, k_for, topk_energy
from lightning_sparse.wire import Collectives


# --------------------------------------------------------------------------- constant / warm-up
def test_constant_density_and_as_schedule() -> None:
    s = ConstantDensity(0.02)
    assert [s.density(t) for t in (0, 1, 10**6)] == [0.02, 0.02, 0.02]
    assert isinstance(as_schedule(0.3), ConstantDensity) and as_schedule(0.3).density(5) == 0.3
    assert as_schedule(s) is s


def test_a_constant_density_is_read_and_a_subclass_asked() -> None:
    """The exchange reads a ConstantDensity's ``constant``; a subclass with its own density() is asked each step,
    and a schedule that does not observe has no step to end."""
    assert ConstantDensity(0.02).constant == 0.02 and WarmupDensity().constant is None
    asked: list[int] = []

    class Halving(ConstantDensity):
        def density(self, step: int) -> float:
            asked.append(step)
            return 0.02 / 2**step

        def end_step(self, step: int) -> int:
            raise AssertionError("end_step of a schedule that does not observe")

    assert Halving(0.02).constant is None
    state = SparseState(density=Halving(0.02), warmup_steps=1, min_numel=1, fallback_to_dense=False)
    w = torch.nn.Parameter(torch.zeros(4096))
    state.bind([("w", w)])
    sent = []
    for _ in range(3):  # the first is the dense warm-up
        bucket(state, torch.randn(4096), state.plan(torch.zeros(4096), [w])).wait()
        sent.append(state.telemetry.last.sent_numel)
    assert asked == [1, 2] and sent[1:] == [41, 20] and state.step == 3


def test_warmup_exponential_documented_values() -> None:
    s = WarmupDensity(start=0.25, end=0.001, steps=4)
    got = [s.density(t) for t in range(7)]
    ratio = (0.001 / 0.25) ** 0.25  # the same factor every step, like DGC's 0.25 -> 0.0625 -> ...
    expected = [0.25 * ratio**t for t in range(4)] + [0.001] * 3
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[0] == 0.25 and got[4] == 0.001  # the end points exactly
    assert all(a > b for a, b in zip(got[:4], got[1:5], strict=True))
    # halfway through, the geometric mean of start and end
    assert WarmupDensity(0.1, 0.001, steps=100).density(50) == pytest.approx(0.01, rel=1e-12)


def test_warmup_linear_documented_values() -> None:
    s = WarmupDensity(start=0.5, end=0.1, steps=4, mode="linear")
    assert [s.density(t) for t in range(6)] == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1, 0.1], abs=1e-15)
    # warming *up* is allowed too
    assert WarmupDensity(0.01, 0.1, steps=10, mode="linear").density(5) == pytest.approx(0.055)


def test_warmup_is_stateless_and_pickles() -> None:
    s = WarmupDensity(0.2, 0.002, steps=50, mode="linear")
    clone = pickle.loads(pickle.dumps(s))
    assert [clone.density(t) for t in range(60)] == [s.density(t) for t in range(60)]
    assert s.state_dict() == {}
    assert repr(s) == "WarmupDensity(start=0.2, end=0.002, steps=50, mode='linear')"


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"start": 0.0}, r"start=0.0 is not allowed: expected a number in \(0, 1\]"),
        ({"end": 1.5}, r"end=1.5 is not allowed"),
        ({"steps": 0}, r"steps=0 is not allowed: expected an integer >= 1"),
        ({"steps": 2.5}, r"steps=2.5 is not allowed: expected an integer"),
        ({"mode": "cosine"}, r"mode='cosine' is not allowed: expected 'exponential' or 'linear'"),
    ],
)
def test_warmup_bad_arguments(kwargs, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        WarmupDensity(**kwargs)


# --------------------------------------------------------------------------- adaptive: arguments
def test_adaptive_rejects_zero_overhead_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match=r"c0=0 is not allowed: .*> 0 .*degenerates to k = 1"):
        AdaptiveDensity(cost_model="bits", c0=0)
    with pytest.raises(ValueError, match=r"c0=None is not allowed: .*overhead in bits > 0"):
        AdaptiveDensity(cost_model="bits")
    with pytest.raises(ValueError, match=r"c0=-5 is not allowed"):
        AdaptiveDensity(cost_model="bits", c0=-5)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"cost_model": "time"}, r"cost_model='time' is not allowed: expected 'bits' or 'latency_bandwidth'"),
        ({"min_density": 0}, r"min_density=0.0 is not allowed: expected a number in \(0, 1\]"),
        ({"max_density": 2}, r"max_density=2.0 is not allowed"),
        ({"min_density": 0.1, "max_density": 0.01}, r"max_density=0.01 is not allowed: expected .*\[min_density"),
        ({"candidates": 1}, r"candidates=1 is not allowed: expected an integer >= 2 when"),
        ({"candidates": 0}, r"candidates=0 is not allowed"),
        ({"alpha": 0.0}, r"alpha=0.0 is not allowed: expected None or a finite number > 0"),
        ({"beta": float("inf")}, r"beta=inf is not allowed"),
        ({"c0": 1000}, r"c0=1000 is not allowed: expected None with cost_model='latency_bandwidth'"),
        ({"cost_model": "bits", "c0": 10, "alpha": 1e-5}, r"alpha=1e-05 is not allowed: expected None with .*bits"),
        ({"cost_model": "bits", "c0": 10, "c1": 0}, r"c1=0 is not allowed"),
        ({"initial_density": 0}, r"initial_density=0.0 is not allowed"),
        ({"interval": 0}, r"interval=0 is not allowed: expected an integer >= 1"),
    ],
)
def test_adaptive_bad_arguments(kwargs, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        AdaptiveDensity(**kwargs)


def test_adaptive_candidates_are_log_spaced_within_bounds() -> None:
    s = AdaptiveDensity(cost_model="bits", c0=1e4, min_density=0.001, max_density=0.1, candidates=3)
    assert s.grid == pytest.approx((0.001, 0.01, 0.1))
    assert AdaptiveDensity(min_density=0.05, max_density=0.05, candidates=1).grid == (0.05,)
    assert s.density(0) == 0.01  # initial_density before any statistics


# --------------------------------------------------------------------------- adaptive: the estimate
def _exact(p: torch.Tensor, ks: list[int]) -> torch.Tensor:
    return p.double().square().sort(descending=True).values.cumsum(0)[torch.tensor(ks) - 1]


def test_topk_energy_exact_on_small_tensors() -> None:
    p = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    ks = [1, 5, 50, 500, 4999, 5000]
    got = topk_energy(p, ks)
    assert torch.allclose(got[:-1], _exact(p, ks), rtol=1e-6)
    assert got[-1].item() == pytest.approx(float(p.double().square().sum()), rel=1e-6)


@pytest.mark.parametrize("kind", ["gaussian", "heavy", "mostly_zero", "bf16"])
def test_topk_energy_close_on_large_tensors(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    d = 300_000
    p = torch.randn(d, generator=g)
    if kind == "heavy":
        p = p**3
    if kind == "mostly_zero":
        p[torch.rand(d, generator=g) < 0.95] = 0.0
    if kind == "bf16":
        p = p.to(torch.bfloat16)
    ks = [1, 3, 30, 300, 1000, 3000, 30_000, 75_000, 150_000]
    got = topk_energy(p, ks)[:-1]
    exact = _exact(p.float(), ks)
    # exact points every 2**(1/16) in p^2, linear in between: within a fraction of a percent, never above
    assert ((got - exact).abs() / exact).max() < 3e-3, (got / exact - 1).tolist()
    assert torch.allclose(got[:4], exact[:4], rtol=1e-6)  # the largest few thousand: exact
    assert (got <= exact * (1 + 1e-6)).all()  # float32 sums inside the bins: 1e-7-ish


def test_topk_energy_flat_and_zero_large_tensors() -> None:
    assert topk_energy(torch.full((200_000,), -2.0), [1, 100, 100_000]).tolist() == [4.0, 400.0, 400_000.0, 800_000.0]
    assert topk_energy(torch.zeros(200_000), [1, 100]).tolist() == [0.0, 0.0, 0.0]


def test_topk_energy_non_finite_gives_nan() -> None:
    p = torch.randn(100_000)
    p[7] = float("nan")
    assert torch.isnan(topk_energy(p, [10, 100])).all()
    p[7] = float("inf")
    assert not torch.isfinite(topk_energy(p, [10, 100])[-1])


# --------------------------------------------------------------------------- adaptive: the rule
def _bound(
    schedule: AdaptiveDensity, world: int = 2, compressor: str = "topk", fallback: bool = True, compact: bool = False
) -> None:
    """Set up as on ``world`` processes (int32 indices unless ``compact``: the cost models below
    are written out for them)."""
    state = SparseState(compressor=compressor, density=schedule, fallback_to_dense=fallback, compact_indices=compact)
    wire = dataclasses.replace(state.wire, comm=Collectives(world=world))  # as if bound to `world` processes
    schedule.setup(wire, torch.device("cpu"), torch.float32)  # nothing here communicates


def _power_law_energy(sizes: list[int], grid: tuple[float, ...], a: float) -> list[float]:
    """Energies of a bucket whose top-k energy grows like k**a (total 1 per tensor)."""
    row = [sum((k_for(d, x) / d) ** a for d in sizes) for x in grid]
    return row + [float(len(sizes))]


def _brute_force(s: AdaptiveDensity, sizes: list[int], row: list[float]) -> float:
    def bits(k: int) -> int:  # float32 value + int32 index per coordinate, the message padded to 8 bytes
        return 8 * ((8 * k + 7) // 8 * 8)

    ratios = [row[j] / (s.c0 + bits(sum(k_for(d, x) for d in sizes))) for j, x in enumerate(s.grid)]
    return s.grid[max(range(len(ratios)), key=lambda j: (ratios[j], -j))]


def test_choose_is_the_argmax_of_energy_per_bit() -> None:
    sizes = [100_000, 20_000]
    for c0 in (1e3, 1e5, 1e6, 1e7):
        s = AdaptiveDensity(cost_model="bits", c0=c0, min_density=1e-4, max_density=0.25)
        _bound(s)
        row = _power_law_energy(sizes, s.grid, a=0.4)
        assert s.choose([("b", sizes)], [row]) == _brute_force(s, sizes, row)


def test_choose_prices_compact_indices() -> None:
    """With compact indices a message costs its Rice-coded size: cheaper coordinates, so the same
    overhead buys a density at least as high."""
    from lightning_sparse.wire import MessageLayout

    sizes = [100_000, 20_000]
    for c0 in (1e3, 1e5, 1e6):
        s = AdaptiveDensity(cost_model="bits", c0=c0, min_density=1e-4, max_density=0.25)
        _bound(s, compact=True)
        row = _power_law_energy(sizes, s.grid, a=0.4)
        n = sum(sizes)
        costs = [s.c0 + 8 * MessageLayout(n, sum(k_for(d, x) for d in sizes), torch.float32, True).size for x in s.grid]
        ratios = [row[j] / costs[j] for j in range(len(s.grid))]
        expected = s.grid[max(range(len(ratios)), key=lambda j: (ratios[j], -j))]
        assert s.choose([("b", sizes)], [row]) == expected
        plain = AdaptiveDensity(cost_model="bits", c0=c0, min_density=1e-4, max_density=0.25)
        _bound(plain)
        assert expected >= plain.choose([("b", sizes)], [row])


def test_choose_grows_with_the_overhead_and_degenerates_without_it() -> None:
    sizes = [100_000]
    chosen = []
    for c0 in (1e-9, 1e3, 1e4, 1e5, 1e6, 1e8):
        s = AdaptiveDensity(cost_model="bits", c0=c0, min_density=1e-4, max_density=0.25)
        _bound(s)
        chosen.append(s.choose([("b", sizes)], [_power_law_energy(sizes, s.grid, a=0.4)]))
    assert chosen == sorted(chosen) and chosen[0] == 1e-4 and chosen[-1] == pytest.approx(0.25)
    assert len(set(chosen)) >= 4
    # for energy ~ k**a and cost c0 + c1*k the optimum is k* = a/(1-a) * c0/c1: check one of them
    s = AdaptiveDensity(cost_model="bits", c0=1e6, min_density=1e-4, max_density=0.25, candidates=200)
    _bound(s)
    got = s.choose([("b", sizes)], [_power_law_energy(sizes, s.grid, a=0.4)])
    assert got * 100_000 == pytest.approx(0.4 / 0.6 * 1e6 / 64, rel=0.05)


def test_choose_costs_fallback_buckets_as_dense() -> None:
    # On 2 processes an all-gather of (fp32 value, int32 index) pairs costs more than a dense
    # all-reduce from density 0.5 on: there the bucket goes dense, with all of its energy.
    sizes = [10_000]
    s = AdaptiveDensity(cost_model="bits", c0=1e9, min_density=0.1, max_density=1.0, candidates=10)
    _bound(s, world=2)
    row = _power_law_energy(sizes, s.grid, a=0.5)
    # huge overhead: the most energy per message wins; dense (32 bits/element) beats sparse at 0.4
    assert s.choose([("b", sizes)], [row]) >= 0.5
    _bound(s, world=2, fallback=False)  # no fallback: density 1 sends 64 bits/element
    assert s.choose([("b", sizes)], [row]) == pytest.approx(1.0)


def test_choose_latency_bandwidth_uses_wire_bytes() -> None:
    sizes = [1_000_000]
    grid_kwargs = {"min_density": 1e-4, "max_density": 0.25, "candidates": 30}
    slow_start = AdaptiveDensity(alpha=1e-3, beta=1e-9, **grid_kwargs)  # latency = 1 MB of bandwidth
    fast_start = AdaptiveDensity(alpha=1e-6, beta=1e-9, **grid_kwargs)
    for s in (slow_start, fast_start):
        _bound(s, world=2)
    row = _power_law_energy(sizes, slow_start.grid, a=0.4)
    assert slow_start.choose([("b", sizes)], [row]) > fast_start.choose([("b", sizes)], [row])
    assert slow_start.cost_parameters == {"alpha": 1e-3, "beta": 1e-9}


def test_choose_keeps_density_when_nothing_to_learn() -> None:
    s = AdaptiveDensity(cost_model="bits", c0=1e4, initial_density=0.03)
    _bound(s)
    assert s.choose([("b", [5000])], [[0.0] * (len(s.grid) + 1)]) == 0.03
    assert s.choose([("b", [5000])], [[float("nan")] * (len(s.grid) + 1)]) == 0.03


def test_adaptive_on_one_process_learns_from_observations() -> None:
    s = AdaptiveDensity(cost_model="bits", c0=1e5, min_density=1e-3, max_density=0.25)
    # on one process every bucket goes dense (nothing to save); without the fallback the rule is live
    state = SparseState(density=s, fallback_to_dense=False)
    state.bind([("w", torch.nn.Parameter(torch.zeros(50_000)))])
    s = state.schedule  # the state's own copy of the setting: the one that learns
    g = torch.Generator().manual_seed(0)
    flat, spiky = torch.randn(50_000, generator=g), torch.randn(50_000, generator=g) ** 5
    chosen = []
    for p in (flat, spiky):
        s.observe(0, "b", "w", p)
        s.end_step(0)
        chosen.append(s.density(1))
    assert chosen[0] > chosen[1]  # flat gradients need more coordinates than spiky ones
    s.observe(5, "b", "w", flat)
    s.end_step(5)
    assert s.density(6) == chosen[0] and s.state_dict()["decided_step"] == 6


def test_adaptive_interval_skips_statistics_steps() -> None:
    s = AdaptiveDensity(cost_model="bits", c0=1e5, interval=3)
    state = SparseState(density=s)
    state.bind([("w", torch.nn.Parameter(torch.zeros(5000)))])
    s = state.schedule  # the state's own copy of the setting: the one that learns
    for step in range(7):
        s.observe(step, "b", "w", torch.randn(5000))
        s.end_step(step)
        s.density(step + 1)
        assert s.state_dict()["decided_step"] == 3 * (step // 3) + 1


# --------------------------------------------------------------------------- state and pickling
def test_adaptive_state_round_trips_and_pickles() -> None:
    s = AdaptiveDensity(cost_model="bits", c0=1e5, min_density=1e-3, max_density=0.25)
    state = SparseState(density=s)
    state.bind([("w", torch.nn.Parameter(torch.zeros(20_000)))])
    s = state.schedule  # the state's own copy of the setting: the one that learns
    s.observe(0, "b", "w", torch.randn(20_000) ** 3)
    s.end_step(0)  # leaves the decision pending: state_dict and pickle must fold it in
    saved = s.state_dict()
    assert saved["density"] != s.initial_density and saved["decided_step"] == 1
    buf = io.BytesIO()
    torch.save(saved, buf)
    fresh = AdaptiveDensity(cost_model="bits", c0=1e5, min_density=1e-3, max_density=0.25)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert fresh.density(1) == s.density(1) and fresh.state_dict() == saved

    s.observe(1, "b", "w", torch.randn(20_000))
    s.end_step(1)
    clone = pickle.loads(pickle.dumps(s))
    assert clone._ctx.comm.group is None and clone._pending is None
    assert clone.density(2) == s.density(2) and clone.state_dict() == s.state_dict()
    # measured network figures travel with the state and are reused on resume
    lb = AdaptiveDensity()
    lb.load_state_dict(
        {"density": 0.02, "decided_step": 7, "measured": {"alpha": 2e-5, "beta": 3e-10, "world_size": 2}}
    )
    assert lb.cost_parameters == {"alpha": 2e-5, "beta": 3e-10} and lb.density(7) == 0.02


def test_strategy_state_pickles_with_schedules() -> None:
    for schedule in (WarmupDensity(0.25, 0.001, 10), AdaptiveDensity(cost_model="bits", c0=1e5)):
        strategy = SparseDDPStrategy(density=schedule)
        clone = pickle.loads(pickle.dumps(strategy.sparse_state))
        assert repr(clone.schedule) == repr(schedule)
        assert clone.schedule.density(3) == schedule.density(3)


# --------------------------------------------------------------------------- never slower than dense
def _fallback_steps(schedule: WarmupDensity, world: int, steps: int, numel: int = 100_000) -> list[bool]:
    """Per step: would a one-tensor bucket go dense (the hook's rule) at this schedule's density?
    (all-gathered int32 indices, for which the thresholds below are written out)"""
    state = SparseState(density=schedule, exchange="allgather", compact_indices=False)
    state.use_collectives(Collectives(world=world), rank=0)  # the rule needs only the world size and sizes
    buffer = torch.zeros(numel)
    sparse = (Member("w", 0, 0, numel, True),)
    return [not sparse_is_cheaper(state, buffer, sparse, [k_for(numel, schedule.density(t))]) for t in range(steps)]


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_fallback_threshold_is_one_over_world_size(world: int) -> None:
    # all-gather of 8-byte pairs: (W-1)*8k bytes; ring all-reduce of fp32: 2(W-1)/W*4d: equal at k = d/W
    for density in (0.9 / world, 1.1 / world):
        dense = _fallback_steps(ConstantDensity(density), world, 1)[0]
        assert dense == (density > 1 / world)


@pytest.mark.parametrize("world", [2**i for i in range(1, 11)])
def test_default_exchange_stays_below_dense_and_flat(world: int) -> None:
    """The defaults (exchange="auto", compact indices) at top-k 1%: sparse while cheaper than dense
    at any W up to 1024, and at W = 64 and beyond at most 1/15 of dense's wire bytes."""
    from lightning_sparse.wire import PATTERNS, ring_all_reduce_bytes

    numel = 4_000_000
    state = SparseState(density=0.01)
    state.use_collectives(Collectives(world=world), rank=0)
    ks = [k_for(numel, 0.01)]
    wire = PATTERNS["gather"].wire_bytes(
        world, ks, 4, [numel], None, state.config.exchange, state.config.compact_indices
    )
    dense = ring_all_reduce_bytes(world, 4 * numel)
    assert sparse_is_cheaper(state, torch.zeros(1), (Member("w", 0, 0, numel, True),), ks) == (wire < dense)
    assert wire < dense
    if world >= 64:
        assert wire <= dense / 15


def test_warmup_from_high_density_goes_dense_first_at_larger_world_sizes() -> None:
    s = WarmupDensity(start=0.25, end=0.001, steps=10)  # 0.25, 0.144, 0.083, 0.048, ...
    assert _fallback_steps(s, world=2, steps=4) == [False, False, False, False]
    assert _fallback_steps(s, world=4, steps=4) == [True, False, False, False]
    assert _fallback_steps(s, world=8, steps=4) == [True, True, False, False]
    assert _fallback_steps(s, world=16, steps=5) == [True, True, True, False, False]
    assert math.isclose(s.density(3), 0.25 * (0.004**0.3))


def test_choose_with_random_k_uses_the_expected_energy_of_a_random_subset() -> None:
    # random-k sends k/d of the energy in expectation: per bit that only improves with k
    s = AdaptiveDensity(cost_model="bits", c0=1e4, min_density=1e-3, max_density=0.25)
    _bound(s, world=2, compressor="randomk")
    sizes = [100_000]
    assert s.choose([("b", sizes)], [_power_law_energy(sizes, s.grid, a=0.2)]) == pytest.approx(0.25)
    _bound(s, world=2, compressor="topk")
    assert s.choose([("b", sizes)], [_power_law_energy(sizes, s.grid, a=0.2)]) < 0.01


# --------------------------------------------------------------------------- Lightning CLI
def test_lightning_cli_builds_schedules_from_yaml() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(SparseDDPStrategy, "strategy")
    config = parser.parse_string(
        """
strategy:
  density:
    class_path: lightning_sparse.AdaptiveDensity
    init_args: {cost_model: bits, c0: 20000, min_density: 0.0005, max_density: 0.1}
"""
    )
    schedule = parser.instantiate(config).strategy.sparse_state.schedule
    assert isinstance(schedule, AdaptiveDensity) and schedule.c0 == 20000 and schedule.max_density == 0.1
    config = parser.parse_string("strategy:\n  density:\n    class_path: WarmupDensity\n    init_args: {steps: 50}\n")
    schedule = parser.instantiate(config).strategy.sparse_state.schedule
    assert isinstance(schedule, WarmupDensity) and schedule.steps == 50 and schedule.mode == "exponential"
    bad = "strategy:\n  density:\n    class_path: AdaptiveDensity\n    init_args: {cost_model: bits, c0: 0}\n"
    with pytest.raises(ValueError, match=r"c0=0.0 is not allowed"):
        parser.instantiate(parser.parse_string(bad))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_topk_energy_on_cuda_matches_cpu() -> None:
    p = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0)) ** 3
    ks = [1, 100, 1000, 10_000, 250_000]
    got = topk_energy(p.cuda(), ks)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), topk_energy(p, ks), rtol=1e-5, atol=0.0)
