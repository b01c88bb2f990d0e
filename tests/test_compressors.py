"""Compressors on plain tensors: selections are exact, in range, unique and deterministic."""

from __future__ import annotations

import pytest
import torch

from lightning_sparse.compressors import (
    COMPRESSORS,
    CompressContext,
    Compressor,
    RandomK,
    TopK,
    exact_topk_indices,
    get_compressor,
    random_subset,
    register_compressor,
)


def _as_set(idx: torch.Tensor) -> set[int]:
    return set(idx.tolist())


def assert_is_topk(x: torch.Tensor, idx: torch.Tensor, k: int) -> None:
    """idx is a top-k of |x|: k unique indices whose magnitudes are the k largest (ties either way)."""
    assert idx.numel() == k and idx.unique().numel() == k
    got = x.abs()[idx].sort().values
    ref = torch.topk(x.abs(), k).values.sort().values
    assert torch.equal(got, ref)


@pytest.mark.parametrize("d,k", [(10, 3), (5000, 50), (200_000, 2000), (200_000, 200), (300_000, 1)])
def test_exact_topk_matches_torch_topk(d: int, k: int) -> None:
    x = torch.randn(d, generator=torch.Generator().manual_seed(d + k))
    got = exact_topk_indices(x, k, torch.Generator().manual_seed(1))
    assert_is_topk(x, got, k)


def test_exact_topk_heavy_tails_and_planted_spikes() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    x = torch.distributions.StudentT(1.5).sample((400_000,)).clamp(-1e4, 1e4) * 1e-3
    spikes = torch.randperm(400_000, generator=g)[:1000]
    x[spikes] = 100.0 * torch.sign(torch.randn(1000, generator=g))
    got = exact_topk_indices(x, 1000, torch.Generator().manual_seed(0))
    assert _as_set(got) == _as_set(spikes)
    assert_is_topk(x, exact_topk_indices(x, 4000, torch.Generator().manual_seed(0)), 4000)


def test_exact_topk_mostly_zero_tensor_still_returns_k() -> None:
    x = torch.zeros(500_000)
    x[:10] = torch.arange(1, 11, dtype=torch.float32)
    got = exact_topk_indices(x, 5000, torch.Generator().manual_seed(0))
    assert got.numel() == 5000 and got.unique().numel() == 5000
    assert set(range(10)) <= _as_set(got)


def test_topk_select_fast_and_plain_agree() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    ctx = CompressContext(step=3, key=7)
    assert_is_topk(x, TopK().select(x, 1000, ctx), 1000)
    assert_is_topk(x, TopK(fast=False).select(x, 1000, ctx), 1000)


@pytest.mark.parametrize("d,k", [(10, 10), (10, 4), (1000, 10), (1_000_000, 10_000), (1_000_000, 300_000)])
def test_random_subset_is_exactly_k_unique_in_range(d: int, k: int) -> None:
    idx = random_subset(d, k, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert idx.numel() == k
    assert idx.unique().numel() == k
    assert int(idx.min()) >= 0 and int(idx.max()) < d


def test_random_subset_is_uniform() -> None:
    # Each of 20 coordinates drawn with probability k/d = 0.25: 4000 draws, ~1000 hits each.
    counts = torch.zeros(20)
    g = torch.Generator().manual_seed(0)
    for _ in range(4000):
        counts[random_subset(20, 5, g, torch.device("cpu"))] += 1
    assert counts.min() > 880 and counts.max() < 1120


def test_randomk_shared_across_ranks_and_changes_with_step() -> None:
    x0, x1 = torch.randn(50_000), torch.randn(50_000)
    a = RandomK().select(x0, 500, CompressContext(step=5, key=11, rank=0, world_size=2))
    b = RandomK().select(x1, 500, CompressContext(step=5, key=11, rank=1, world_size=2))
    c = RandomK().select(x0, 500, CompressContext(step=6, key=11, rank=0, world_size=2))
    d = RandomK().select(x0, 500, CompressContext(step=5, key=12, rank=0, world_size=2))
    assert torch.equal(a, b)  # same on every rank whatever the values
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_compressors_do_not_touch_global_rng() -> None:
    small, large = torch.randn(10_000), torch.randn(200_000)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    RandomK().select(small, 100, CompressContext(step=1))
    TopK().select(large, 100, CompressContext(step=1))  # samples for its threshold
    assert torch.equal(torch.random.get_rng_state(), before)


def test_registry_and_lookup() -> None:
    assert COMPRESSORS["topk"] is TopK and COMPRESSORS["randomk"] is RandomK
    assert isinstance(get_compressor("topk"), TopK)
    assert isinstance(get_compressor("TopK"), TopK)
    inst = RandomK()
    assert get_compressor(inst) is inst
    with pytest.raises(ValueError, match=r"compressor='nope' is not allowed: .*'randomk'.*'topk'"):
        get_compressor("nope")


def test_register_compressor_one_line() -> None:
    @register_compressor
    class FirstK(Compressor):
        name = "firstk_test"
        pattern = "shared"

        def select(self, p: torch.Tensor, k: int, ctx: CompressContext) -> torch.Tensor:
            return torch.arange(k)

    try:
        assert isinstance(get_compressor("firstk_test"), FirstK)
        with pytest.raises(ValueError, match="already taken"):

            @register_compressor
            class Other(Compressor):
                name = "firstk_test"

                def select(self, p: torch.Tensor, k: int, ctx: CompressContext) -> torch.Tensor:
                    return torch.arange(k)

    finally:
        COMPRESSORS.pop("firstk_test")


def test_compressor_config_repr_eq() -> None:
    assert TopK(fast=False).config() == {"fast": False}
    assert repr(TopK()) == "TopK(fast=True)"
    assert TopK() == TopK() and TopK() != TopK(fast=False) and TopK() != RandomK()
    with pytest.raises(ValueError, match="fast=1 is not allowed"):
        TopK(fast=1)  # type: ignore[arg-type]


def test_at_once_rule_is_declared_by_the_class_whose_choice_it_reproduces() -> None:
    """The wire selects a bucket at once only for a compressor that declares the rule: a subclass
    that picks otherwise (its own ``select``) goes one tensor at a time, one that only renames keeps it."""
    from lightning_sparse.compressors import CountSketch, RandomK, TopK

    class Slower(TopK):
        def select(self, p: torch.Tensor, k: int, ctx: CompressContext) -> torch.Tensor:
            return super().select(p, k, ctx)

    class Renamed(RandomK):
        pass

    assert TopK().selects_at_once("topk") and not TopK(fast=False).selects_at_once("topk")
    assert not Slower().selects_at_once("topk")
    assert Renamed().selects_at_once("randomk") and not Renamed().selects_at_once("topk")
    assert CountSketch().selects_at_once("countsketch")
    assert not any(
        get_compressor(name).selects_at_once(rule)
        for name in ("rtopk", "gaussiank", "dgc", "randomblock")
        for rule in ("topk", "randomk", "countsketch")
    )


def test_the_exchange_sends_as_many_coordinates_as_the_compressor_declares() -> None:
    """``Compressor.k_for`` sizes every tensor's selection: the exchange's message, the byte rule's
    cost and ``exchange_cost`` follow a compressor that declares its own count; the default rule is
    ``k_for`` (today's ``round(density * numel)``), answered once per sizes and density."""
    from lightning_sparse import SparseConfig, SparseState, exchange_cost
    from lightning_sparse.compressors import k_for
    from lightning_sparse.exchange.hook import communicate

    class Twice(TopK):  # selects as top-k does (at once included), twice as many
        def k_for(self, numel: int, density: float) -> int:
            return min(numel, 2 * super().k_for(numel, density))

    assert TopK().k_for(5000, 0.01) == k_for(5000, 0.01) == 50
    assert Twice().ks_for((5000, 300), 0.01) == [100, 6] and Twice().ks_for((5000, 300), 0.01) == [100, 6]
    for compressor, k in ((TopK(), 50), (Twice(), 100)):
        named = [("w", torch.zeros(5000, requires_grad=True))]
        state = SparseState(compressor=compressor, density=0.01, min_numel=0, fallback_to_dense=False)
        state.bind(named)
        communicate(state, torch.zeros(5000), [named[0][1]]).wait()  # the dense warm-up step
        g = torch.randn(5000, generator=torch.Generator().manual_seed(0))
        out = communicate(state, g.clone(), [named[0][1]]).wait()
        assert int((out != 0).sum()) == k
        assert torch.equal(out + state.memory.get("w"), g)  # nothing lost
        assert_is_topk(g, out.nonzero().squeeze(1), k)
    one = exchange_cost(SparseConfig(compressor=TopK(), density=0.01), [100_000], world_size=2)[0]
    two = exchange_cost(SparseConfig(compressor=Twice(), density=0.01), [100_000], world_size=2)[0]
    assert two > 1.9 * one
