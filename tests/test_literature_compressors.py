"""rTop-k, Gaussian-k, DGC, random-block and count-sketch on plain tensors: their defining properties."""

from __future__ import annotations

import functools
import json
import math
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse import SparseDDPStrategy
from lightning_sparse.compressors import (
    COMPRESSORS,
    DGC,
    CompressContext,
    CountSketch,
    GaussianK,
    RandomBlock,
    RTopK,
    TopK,
    exact_topk_indices,
    get_compressor,
)
from lightning_sparse.compressors.sketch_hashes import median_of_rows
from lightning_sparse.compressors.topk import _CHUNK, indices_at_least
from lightning_sparse.exchange.step import sparse_is_cheaper

ROOT = Path(__file__).resolve().parents[1]
NEW = {"rtopk": RTopK, "gaussiank": GaussianK, "randomblock": RandomBlock, "countsketch": CountSketch, "dgc": DGC}


def assert_is_topk(x: torch.Tensor, idx: torch.Tensor, k: int) -> None:
    """idx is a top-k of |x|: k unique indices whose magnitudes are the k largest (ties either way)."""
    assert idx.numel() == k and idx.unique().numel() == k
    got = x.abs()[idx].float().sort().values
    ref = torch.topk(x.abs().float(), k).values.sort().values
    assert torch.equal(got, ref)


def ctx(step: int = 1, key: int = 7, rank: int = 0) -> CompressContext:
    return CompressContext(step=step, key=key, rank=rank, world_size=2, seed=3)


# --------------------------------------------------------------------------- registry and arguments
def test_registered_by_name_and_selectable_in_the_strategy() -> None:
    for name, cls in NEW.items():
        assert COMPRESSORS[name] is cls
        assert isinstance(get_compressor(name), cls)
        strategy = SparseDDPStrategy(compressor=name, density=0.01)
        assert isinstance(strategy.sparse_state.compressor, cls)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: RTopK(r_factor=0.5), r"r_factor=0.5 is not allowed: expected a finite number >= 1"),
        (lambda: RTopK(r_factor=float("inf")), r"r_factor=inf is not allowed"),
        (lambda: RTopK(r_factor=True), r"r_factor=True is not allowed"),
        (lambda: GaussianK(rounds=-1), r"rounds=-1 is not allowed: expected an integer >= 0"),
        (lambda: GaussianK(rounds=1.5), r"rounds=1.5 is not allowed: expected an integer"),
        (lambda: DGC(sample_fraction=0.0), r"sample_fraction=0.0 is not allowed: expected a number in \(0, 1\]"),
        (lambda: DGC(sample_fraction=2), r"sample_fraction=2 is not allowed"),
        (lambda: DGC(lower=1.0), r"lower=1.0 is not allowed: expected a number in \(0, 1\)"),
        (lambda: DGC(rounds=-2), r"rounds=-2 is not allowed"),
        (lambda: CountSketch(rows=4), r"rows=4 is not allowed: expected an odd integer"),
        (lambda: CountSketch(rows=0), r"rows=0 is not allowed: expected an integer >= 1"),
        (lambda: CountSketch(width=0), r"width=0 is not allowed: expected a finite number > 0"),
        (lambda: CountSketch(width=float("nan")), r"width=nan is not allowed"),
        (lambda: CountSketch(p2=0.5), r"p2=0.5 is not allowed: expected a finite number >= 1"),
        (lambda: CountSketch(p1=0.5), r"p1=0.5 is not allowed: expected 'auto', 0 \(no pre-truncation\)"),
        (lambda: CountSketch(p1="all"), r"p1='all' is not allowed"),
        (lambda: CountSketch(p1=-1), r"p1=-1 is not allowed"),
    ],
)
def test_bad_arguments_raise_naming_argument_and_value(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_config_repr_equality_and_pickling() -> None:
    assert RTopK(r_factor=2).config() == {"r_factor": 2.0}
    assert GaussianK().config() == {"rounds": 3}
    assert DGC().config() == {"sample_fraction": 0.01, "lower": 0.8, "rounds": 10}
    assert RandomBlock().config() == {}
    assert CountSketch().config() == {"rows": 5, "width": 10.0, "p2": 4.0, "p1": "auto"}
    assert repr(CountSketch(p1=0)) == "CountSketch(rows=5, width=10.0, p2=4.0, p1=0.0)"
    assert RTopK() == RTopK(4.0) and RTopK() != RTopK(2.0) and CountSketch() != CountSketch(p1=0)
    for cls in NEW.values():
        c = cls()
        assert pickle.loads(pickle.dumps(c)) == c


# --------------------------------------------------------------------------- shared machinery
def test_indices_at_least_across_chunk_boundaries() -> None:
    x = torch.randn(3 * _CHUNK + 5, generator=torch.Generator().manual_seed(0))
    x[_CHUNK - 1] = x[_CHUNK] = x[-1] = 10.0
    got = indices_at_least(x, 2.0)
    assert torch.equal(got, (x.abs() >= 2.0).nonzero().squeeze(1))
    assert indices_at_least(x, 100.0).numel() == 0


@settings(max_examples=25, deadline=None)
@given(
    d=st.integers(1, 200_000),
    density=st.floats(1e-4, 0.5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(["topk", "gaussiank", "dgc"]),
)
def test_magnitude_selectors_are_exact_topk(d, density, dtype, seed, name) -> None:
    """top-k, Gaussian-k and DGC all return exactly k unique indices: the top-k of |p|."""
    x = torch.randn(d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    k = max(1, min(d, round(density * d)))
    idx = get_compressor(name).select(x, k, ctx(step=seed))
    assert idx.dtype == torch.long
    assert_is_topk(x, idx, k)


@pytest.mark.parametrize("name", ["gaussiank", "dgc", "topk"])
@pytest.mark.parametrize(
    "kind", ["normal", "heavy_tailed", "uniform", "few_nonzeros", "constant", "spikes", "shifted_mean"]
)
def test_threshold_selectors_select_exactly_k_on_any_distribution(name, kind) -> None:
    d, k = 300_000, 3000
    g = torch.Generator().manual_seed(1)
    x = {
        "normal": lambda: torch.randn(d, generator=g),
        "heavy_tailed": lambda: torch.randn(d, generator=g) / torch.rand(d, generator=g).clamp_min(1e-3) ** 2,
        "uniform": lambda: torch.rand(d, generator=g),
        "few_nonzeros": lambda: torch.zeros(d).index_fill_(0, torch.arange(0, d, d // 100), 1.5),
        "constant": lambda: torch.full((d,), 0.25),
        "spikes": lambda: torch.randn(d, generator=g).mul_(1e-3).index_fill_(0, torch.arange(0, d, 97), 5.0),
        "shifted_mean": lambda: torch.randn(d, generator=g) + 50.0,
    }[kind]()
    idx = get_compressor(name).select(x, k, ctx())
    assert_is_topk(x, idx, k)


def test_gaussian_threshold_lands_near_k_on_gaussian_data() -> None:
    from lightning_sparse.compressors.gaussiank import gaussian_threshold

    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0)) * 0.01
    for k in (1000, 10_000):
        count = int((x.abs() >= gaussian_threshold(x, k)).sum())
        assert 2 * k / 3 <= count <= 4 * k / 3, count


def _record_shortlists(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of every shortlist (one pass over p each) the threshold selectors make."""
    import lightning_sparse.compressors.dgc as dgc_module
    import lightning_sparse.compressors.gaussiank as gk
    import lightning_sparse.compressors.topk as tk

    sizes: list[int] = []
    original = tk.indices_at_least

    def recording(p: torch.Tensor, threshold: float) -> torch.Tensor:
        out = original(p, threshold)
        sizes.append(out.numel())
        return out

    for module in (gk, dgc_module, tk):  # tk: finish_exactly_k's passes
        monkeypatch.setattr(module, "indices_at_least", recording)
    return sizes


def test_gaussiank_pads_a_short_count_with_a_small_shortlist(monkeypatch: pytest.MonkeyPatch) -> None:
    """A count just below k (noise on Gaussian data) is padded by lowering the threshold a little:
    the result is the exact top-k and no shortlist holds much more than k entries."""
    d, k = 400_000, 4000
    sizes = _record_shortlists(monkeypatch)
    short = 0
    for seed in range(12):
        x = torch.randn(d, generator=torch.Generator().manual_seed(seed))
        sizes.clear()
        idx = GaussianK().select(x, k, ctx())
        assert_is_topk(x, idx, k)
        if sizes[0] < k:
            short += 1
            assert len(sizes) >= 2 and sizes[-1] >= k and max(sizes) <= 3 * k, sizes
    assert short > 0  # the seeds above include counts below k


@functools.lru_cache(maxsize=8)
def _feedback_tensor(d: int, k: int, seed: int) -> torch.Tensor:
    """``g + e`` after 150 steps of top-k error feedback (built once, shared by both selectors)."""
    from benchmarks.compressors import feedback_tensor

    return feedback_tensor(d, k, 150, torch.Generator().manual_seed(seed), torch.device("cpu"))


@pytest.mark.parametrize("name", ["gaussiank", "dgc"])
def test_threshold_selectors_stay_cheap_under_error_feedback(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Under error feedback p = g + e piles up just below the threshold, far from normal. The
    selection stays the exact top-k, with few passes over p and no shortlist much larger than k
    (halving Gaussian-k's threshold shortlisted a fifth of p there, ~50k; DGC's own quantile
    needed a lowering, a second pass, on about half of the steps)."""
    d, k = 250_000, 2500
    sizes = _record_shortlists(monkeypatch)
    compressor = get_compressor(name)
    passes = []
    for seed in range(6):
        x = _feedback_tensor(d, k, seed)
        sizes.clear()
        idx = compressor.select(x, k, ctx(step=seed))
        assert_is_topk(x, idx, k)
        assert max(sizes) <= 6 * k, sizes
        passes.append(len(sizes))
    assert (
        max(passes) <= (2 if name == "gaussiank" else 1) + 1
        and sum(passes) <= 6 * (2 if name == "gaussiank" else 1) + 1
    )


# --------------------------------------------------------------------------- rTop-k
@pytest.mark.parametrize("d,k", [(1000, 10), (200_000, 2000), (300_000, 30)])
def test_rtopk_with_r_factor_one_is_topk(d, k) -> None:
    x = torch.randn(d, generator=torch.Generator().manual_seed(d))
    for step in range(3):
        c = ctx(step=step, rank=step % 2)
        assert torch.equal(RTopK(r_factor=1.0).select(x, k, c), TopK().select(x, k, c))


def test_rtopk_sends_a_random_k_subset_of_the_top_r_per_rank() -> None:
    d, k = 100_000, 500
    x = torch.randn(d, generator=torch.Generator().manual_seed(0))
    top_r = set(torch.topk(x.abs(), 4 * k).indices.tolist())
    picks = [RTopK().select(x, k, ctx(step=2, rank=r)) for r in (0, 1)]
    for idx in picks:
        assert idx.numel() == k and idx.unique().numel() == k and set(idx.tolist()) <= top_r
    assert set(picks[0].tolist()) != set(picks[1].tolist())  # per-rank randomness
    assert torch.equal(picks[0], RTopK().select(x, k, ctx(step=2, rank=0)))  # reproducible


def test_rtopk_is_uniform_over_the_top_r() -> None:
    # d=64, k=4, r=16: each of the top 16 is sent with probability 1/4; 2000 steps -> ~500 each.
    x = torch.arange(64, dtype=torch.float32)
    counts = torch.zeros(64)
    for step in range(2000):
        counts[RTopK().select(x, 4, ctx(step=step))] += 1
    assert counts[:48].sum() == 0
    assert counts[48:].min() > 420 and counts[48:].max() < 580


# --------------------------------------------------------------------------- random-block
def test_randomblock_is_one_contiguous_block_shared_by_all_ranks() -> None:
    d, k = 10_000, 300
    x0, x1 = torch.randn(d), torch.randn(d)
    a = RandomBlock().select(x0, k, ctx(step=4, rank=0))
    b = RandomBlock().select(x1, k, ctx(step=4, rank=1))
    assert torch.equal(a, b)  # the offset does not depend on rank or values
    assert torch.equal(a, (a[0] + torch.arange(k)) % d)  # one block, wrapping at the end
    assert not torch.equal(a, RandomBlock().select(x0, k, ctx(step=5)))
    assert RandomBlock.pattern == "shared"  # values all-reduced, no indices on the wire


def test_randomblock_reaches_every_coordinate_equally_often() -> None:
    # d=50, k=10: every coordinate (the first and last included) is sent with probability 0.2.
    counts = torch.zeros(50)
    for step in range(3000):
        idx = RandomBlock().select(torch.zeros(50), 10, ctx(step=step))
        counts[idx] += 1
    assert counts.min() > 480 and counts.max() < 720, counts


# --------------------------------------------------------------------------- count-sketch
def _sum_of_sketches(cs: CountSketch, ps: list[torch.Tensor], k: int, step: int = 2) -> torch.Tensor:
    d = ps[0].numel()
    table = torch.zeros(cs.table_shape(d, k))
    for r, p in enumerate(ps):
        cs.sketch(p, k, ctx(step=step, key=9, rank=r), table)
    return table


@pytest.mark.parametrize("p1", [0, 10, "auto"])
@pytest.mark.parametrize("d,k,step", [(300_000, 3000, 2), (250_000, 400, 3)])
def test_countsketch_recovers_exact_topk_of_the_sum_when_heavy_hitters_dominate(p1, d, k, step) -> None:
    """Planted spikes on 4 ranks: the candidates (same on every rank) hold the top-k of the sum.

    Exact recovery needs the k spikes not to spoil each other's median: a spike meets another
    spike of opposite sign in 3 of 5 rows with probability ~10 (k / 2 cols)^3, i.e. ~1e-5 per
    spike with cols = 40k (~1e-3 with the default 10k: a few misses among thousands). A
    coordinate meets spikes in 3 of 5 rows with probability ~10 (k / cols)^3, so false
    candidates stay far below the 4k slots. (d, k) cover the long-block (cols >= 16384) and
    short-block searches.
    """
    g = torch.Generator().manual_seed(step)
    world = 4
    spikes = torch.randperm(d, generator=g)[:k]
    signs = torch.sign(torch.randn(k, generator=g))
    ps = []
    for _ in range(world):
        p = torch.randn(d, generator=g) * 0.05
        p[spikes] += (2.0 + torch.rand(k, generator=g)) * signs
        ps.append(p)
    total = torch.stack(ps).sum(0)
    assert set(torch.topk(total.abs(), k).indices.tolist()) == set(spikes.tolist())
    cs = CountSketch(width=40.0, p1=p1)
    table = _sum_of_sketches(cs, ps, k, step=step)
    cand = [cs.candidates(table, d, k, ctx(step=step, key=9, rank=r)) for r in range(2)]
    assert torch.equal(cand[0], cand[1])  # every rank derives the same candidates
    sums = torch.stack([p[cand[0]] for p in ps]).sum(0)
    chosen = cand[0][cs.pick(sums, k)]
    assert set(chosen.tolist()) == set(spikes.tolist())


def test_countsketch_is_linear_and_hashes_are_shared() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(50_000, generator=g), torch.randn(50_000, generator=g)
    cs = CountSketch(p1=0)
    ta, tb, tab = (_sum_of_sketches(cs, [v], 500) for v in (a, b, a + b))
    torch.testing.assert_close(ta + tb, tab, rtol=1e-5, atol=1e-4)
    # rank does not enter the hashes: ranks sketch into the same buckets
    t0 = torch.zeros(cs.table_shape(50_000, 500))
    t1 = torch.zeros_like(t0)
    cs.sketch(a, 500, ctx(step=2, key=9, rank=0), t0)
    cs.sketch(a, 500, ctx(step=2, key=9, rank=1), t1)
    assert torch.equal(t0, t1)


def test_countsketch_hash_is_a_rotation_per_block_and_estimates_are_exact_without_collisions() -> None:
    cs = CountSketch(rows=3, p1=0)
    d, cols = 1000, 100
    h = cs.hashes(ctx(), d, cols, torch.device("cpu"))
    assert h.shifts_t.shape == (3, 10)  # rows x blocks parameters, nothing of size rows x d
    one_hot = torch.zeros(cols, 3)
    for j in range(cols):  # within a block the map offset -> bucket is a bijection
        x = torch.zeros(d)
        x[200 + j] = 1.0
        table = torch.zeros(3, cols)
        cs.sketch(x, 10, ctx(), table)
        assert int((table != 0).sum()) == 3 and set(table.abs().sum(1).tolist()) == {1.0}
        one_hot[j] = table.abs().argmax(1).float()
    assert all(one_hot[:, r].unique().numel() == cols for r in range(3))
    # one block (cols >= numel): every coordinate has its own bucket, the estimates are exact
    x = torch.randn(500)
    table = torch.zeros(3, 500)
    cs.sketch(x, 50, ctx(), table)
    h = cs.hashes(ctx(), 500, 500, torch.device("cpu"))
    assert torch.equal(cs.estimates(table, h, torch.arange(500)), x)


@pytest.mark.parametrize(
    "rows,width,seed",
    [(1, 6.0, 0), (3, 6.0, 0), (5, 6.0, 1), (7, 6.0, 0), (3, 20.0, 1), (5, 20.0, 0)],
)
def test_countsketch_candidates_are_the_exact_top_estimates(rows, width, seed) -> None:
    """The fast candidate search (sampled threshold, heavy-bucket shortlist) finds exactly the
    coordinates a brute-force scan of every median estimate would rank first."""
    from lightning_sparse.compressors.countsketch import _DIRECT, _LONG_BLOCK

    # rows=1 takes the direct path; width 6 the short-block (segment) search, width 20 the long-block one
    assert 3 * 400_000 > _DIRECT >= 400_000 and 6 * 1000 < _LONG_BLOCK <= 20 * 1000
    g = torch.Generator().manual_seed(seed)
    d, k = 400_000, 1000
    x = torch.randn(d, generator=g) * torch.rand(d, generator=g) ** 4
    cs = CountSketch(rows=rows, width=width, p2=3.0, p1=0)
    table = _sum_of_sketches(cs, [x], k)
    c = ctx(step=2, key=9)
    got = cs.candidates(table, d, k, c)
    h = cs.hashes(c, d, table.shape[1], table.device)
    est = cs.estimates(table, h, torch.arange(d)).abs()
    n = cs.num_candidates(d, k)
    assert got.numel() == n and torch.equal(got, got.sort().values)
    kth = torch.topk(est, n).values.min()
    assert bool((est[got] >= kth).all())  # exactly a top-n set of |estimate| (ties either way)
    assert torch.equal(got.sort().values, cs._scan_all(table, h, n).sort().values) or bool(
        (est[cs._scan_all(table, h, n)].sort().values == est[got].sort().values).all()
    )


def test_countsketch_zero_gradient_and_tiny_tensors() -> None:
    cs = CountSketch()
    assert cs.select(torch.zeros(10_000), 100, ctx()).unique().numel() == 100
    for d, k in [(1, 1), (7, 3), (64, 64)]:
        idx = cs.select(torch.randn(d), k, ctx())
        assert idx.numel() == k and idx.unique().numel() == k and int(idx.max()) < d


@settings(max_examples=30, deadline=None)
@given(rows=st.sampled_from([1, 3, 5, 7, 9]), n=st.integers(1, 300), seed=st.integers(0, 1000))
def test_median_of_rows_matches_torch_median(rows, n, seed) -> None:
    v = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)).round(decimals=1)  # ties too
    assert torch.equal(median_of_rows(list(v.unbind(0))), v.median(dim=0).values)


_MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    torch.set_num_threads(1)
    from lightning_sparse.compressors import CompressContext, CountSketch
    k, p1 = int(sys.argv[1]), float(sys.argv[2])
    cs = CountSketch(p1=p1)
    ctx = CompressContext(step=1, key=5)
    cs.select(torch.randn(200_000), 20, ctx)  # warm up code paths and the allocator
    out = []
    for d in map(int, sys.argv[3:]):  # increasing sizes
        p = torch.randn(d)  # a new high-water mark: ru_maxrss now equals the current size
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        idx = cs.select(p, k, ctx)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rows, cols = cs.table_shape(d, k)
        out.append({"d": d, "extra_bytes": 1024 * (after - before), "rows": rows, "cols": cols, "n": idx.numel()})
        del p, idx
    print(json.dumps(out))
    """
)


@pytest.mark.dist
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
@pytest.mark.parametrize("p1", [0, 10])
def test_countsketch_memory_is_rows_times_cols_plus_k_not_rows_times_d(p1) -> None:
    """Peak memory of a whole count-sketch selection, measured (peak RSS of a fresh process) at two
    tensor sizes with the same k: it stays O(rows * cols + k) and does not grow with numel."""
    k, sizes = 2000, (2_000_000, 8_000_000)
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(k), str(p1), *map(str, sizes)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    small, large = json.loads(out.stdout.strip().splitlines()[-1])
    for r in (small, large):
        assert r["n"] == k and r["cols"] == 10 * k
        rows_cols = r["rows"] * r["cols"] * 4
        # O(rows * cols + k) plus a constant: far below a single temporary of p's size
        assert r["extra_bytes"] < 8 * rows_cols + 4 * 1024 * 1024, r
    assert large["extra_bytes"] < large["d"] * 4 / 4, large
    # rows * d int64 hashes would add 240 MB between the two sizes, one fp32 copy of p 24 MB
    assert large["extra_bytes"] - small["extra_bytes"] < (large["d"] - small["d"]) * 4 / 8, (small, large)


def test_countsketch_wire_sizes() -> None:
    cs = CountSketch(rows=5, width=10.0, p2=4.0)
    assert cs.table_shape(100_000, 1000) == (5, 10_000)
    assert cs.table_shape(500, 100) == (5, 500)  # never wider than the tensor
    assert cs.num_candidates(100_000, 1000) == 4000 and cs.num_candidates(3000, 1000) == 3000
    assert math.isclose(cs.truncation(torch.device("cpu")), 10.0)
    assert CountSketch(p1=0).truncation(torch.device("cpu")) == 0.0
    assert CountSketch().truncation(torch.device("cuda")) == 0.0


def test_exact_topk_on_large_tensor_matches_torch_topk() -> None:
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(5))
    for k in (20_000, 2000):
        assert_is_topk(x, exact_topk_indices(x, k, torch.Generator().manual_seed(0)), k)


def test_sketch_wire_bytes_and_dense_fallback_decision() -> None:
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.wire import PATTERNS, Collectives, ring_all_reduce_bytes

    cs = CountSketch(rows=5, width=10.0, p2=4.0)
    expected = ring_all_reduce_bytes(4, 5 * 1000 * 4) + ring_all_reduce_bytes(4, 400 * 2)
    assert PATTERNS["sketch"].wire_bytes(4, [100], 2, [10_000], cs) == expected
    with pytest.raises(ValueError, match="pass compressor"):
        PATTERNS["sketch"].wire_bytes(4, [100], 2, [10_000])
    named = [("w", torch.zeros(10_000, requires_grad=True))]
    for width, cheaper in ((10.0, True), (40.0, False)):  # 5 x 40k tables exceed the 10k tensor
        state = SparseState(compressor=CountSketch(width=width), density=0.01)
        state.bind(named)
        state.use_collectives(Collectives(world=2), rank=0)
        plan = state.plan(torch.zeros(10_000), [p for _, p in named])
        assert sparse_is_cheaper(state, torch.zeros(10_000), plan.sparse_members, [100]) is cheaper


def test_countsketch_candidates_when_few_coordinates_are_non_zero() -> None:
    """Fewer non-zeros than candidates: the sampled threshold is 0 and the exact scan takes over."""
    d, k = 400_000, 1000
    cs = CountSketch(p1=0)
    x = torch.zeros(d)
    spikes = torch.arange(7, d, d // 10)
    x[spikes] = torch.arange(1, spikes.numel() + 1, dtype=torch.float32)
    cand = cs.candidates(_sum_of_sketches(cs, [x], k), d, k, ctx(step=2, key=9))
    assert cand.numel() == cs.num_candidates(d, k) and cand.unique().numel() == cand.numel()
    assert set(spikes.tolist()) <= set(cand.tolist())
    assert set(cs.select(x, k, ctx()).tolist()) >= set(spikes.tolist())
    zero = cs.candidates(torch.zeros(cs.table_shape(d, k)), d, k, ctx())
    assert torch.equal(zero, torch.arange(cs.num_candidates(d, k)))
