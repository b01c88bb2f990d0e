"""Random-k of a whole bucket at once (``lightning_sparse.wire.shared``, ``compressors.randomk.draw_subsets``):
the coordinates ``RandomK.select`` gives each tensor, whatever the bucket's layout; a fixed number of
operators and no host read; conservation exact, residuals in the bucket's flat tensor or offloaded,
inputs substituted or not; a non-finite member sends NaN at the same coordinates; on two ranks, the
same coordinates."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import pytest
import torch

from lightning_sparse.compressors import CompressContext, RandomK
from lightning_sparse.compressors.randomk import SubsetLayout, draw_subsets, draws_needed
from lightning_sparse.wire import shared
from lightning_sparse.wire.context import BucketCall, BucketPlan, Member, WireContext
from lightning_sparse.wire.memory import ErrorFeedback
from lightning_sparse.wire.message import SparseSpace
from lightning_sparse.wire.stats import Counters

#: (name, numel, sparse): sparse members between small ones, names out of buffer order
SIZES = [("w2", 64 * 97, True), ("b2", 64, False), ("w1", 64 * 192, True), ("v", 192, True), ("a", 300, True)]


def _plan(sizes: list[tuple[str, int, bool]] = SIZES) -> BucketPlan:
    members, offset = [], 0
    for name, numel, sparse in sizes:
        members.append(Member(name, 1000 + sum(map(ord, name)), offset, numel, sparse))
        offset += numel
    return BucketPlan(tuple(members), offset, "bucket")


def _ks(plan: BucketPlan, density: float = 0.02) -> list[int]:
    return [max(1, round(density * m.numel)) for m in plan.sparse_members]


def _ctx(**kwargs: Any) -> WireContext:
    return WireContext(RandomK(), True, 0.0, None, 3, "auto", True, None, True, memory=ErrorFeedback(), **kwargs)


def _per_tensor(ctx: WireContext, plan: BucketPlan, ks: list[int], step: int) -> dict[str, torch.Tensor]:
    sparse = plan.sparse_members
    return {
        m.name: RandomK().select(torch.empty(m.numel), k, ctx.compress_context(step, m))
        for m, k in zip(sparse, ks, strict=True)
    }


def _by_name(plan: BucketPlan, coords: torch.Tensor) -> dict[str, torch.Tensor]:
    space = SparseSpace.of(plan)
    return {plan.sparse_members[space.members[i]].name: idx for i, _, idx in space.by_member(coords)}


@pytest.mark.parametrize("density", [0.002, 0.02, 0.6, 1.0])
def test_the_bucket_picks_what_each_tensor_picks_by_itself_whatever_the_layout(density: float) -> None:
    plan = _plan()
    other = _plan(list(reversed(SIZES)))  # the same tensors in another order (DDP's rebuilt buckets)
    alone = _plan([SIZES[2]])  # one of them in a bucket of its own
    for step in range(3):
        picks = {}
        for p in (plan, other, alone):
            ctx, ks = _ctx(), _ks(p, density)
            sel = shared.select_shared(ctx, BucketCall(torch.randn(p.numel), p, step, Counters()), ks, torch.float32)
            got = _by_name(p, sel.coords)
            assert got.keys() == {m.name for m in p.sparse_members}
            for m, k in zip(p.sparse_members, ks, strict=True):
                assert got[m.name].numel() == k and got[m.name].unique().numel() == k
            assert {n: t.tolist() for n, t in got.items()} == {
                n: t.tolist() for n, t in _per_tensor(ctx, p, ks, step).items()
            }
            picks[p] = got
        for name, idx in picks[alone].items():
            assert torch.equal(idx, picks[plan][name]) and torch.equal(idx, picks[other][name])


def test_uniform_over_subsets_and_coordinates() -> None:
    for d, k in [(6, 2), (40, 2), (12, 5)]:  # every coordinate once, and draws
        layout = SubsetLayout.of(((5, 0, d, k),), torch.device("cpu"))
        n = math.comb(d, k)
        runs = max(2_000, 12 * n)  # 12 draws a subset on average: every one seen, the chi-square test valid
        seen = Counter(tuple(draw_subsets(layout, 1, step).tolist()) for step in range(runs))
        assert len(seen) == n
        chi2 = sum((seen[s] - runs / n) ** 2 / (runs / n) for s in seen)
        assert chi2 / (n - 1) < 1.3, (d, k)
    d, k, runs = 3000, 30, 3000
    counts = torch.zeros(d)
    for step in range(runs):
        counts[RandomK().select(torch.empty(d), k, CompressContext(step=step, key=9))] += 1
    expected = runs * k / d
    assert float(((counts - expected) ** 2 / expected).sum()) / (d - 1) < 1.15
    assert draws_needed(100_000, 1000) < 1100 and draws_needed(100, 60) is None


def test_too_few_distinct_draws_fall_back_to_the_lowest_coordinates() -> None:
    layout = SubsetLayout.of(((3, 0, 200, 30),), torch.device("cpu"))
    assert draws_needed(200, 30) is not None
    cut = 31  # a draw the bound would never allow: fewer than 30 distinct among 31 draws is likely
    starved = dataclasses.replace(
        layout,
        member_of=layout.member_of[:cut],
        counter=layout.counter[:cut],
        mods=layout.mods[:, :cut].contiguous(),
        bases=layout.bases[:, :cut].contiguous(),
    )
    lowest = 0
    for step in range(20):
        picks = draw_subsets(starved, 0, step)
        assert picks.unique().numel() == 30 and int(picks.max()) < 200
        lowest += torch.equal(picks, torch.arange(30))
    assert 5 <= lowest < 20


def test_a_fixed_number_of_operators_and_no_host_read() -> None:
    from benchmarks.opcount import OpCounter

    def count(sizes: list[tuple[str, int, bool]], inputs_finite: bool) -> Any:
        plan = _plan(sizes)
        ctx = _ctx()
        ks = _ks(plan)
        for step in range(2):
            call = BucketCall(torch.randn(plan.numel), plan, step, Counters(), inputs_finite=inputs_finite)
            with OpCounter() as ops:
                shared.select_shared(ctx, call, ks, torch.float32)
        return ops

    few = count(SIZES, True)
    many = count([(f"t{i}", 500 + 7 * i, i % 3 != 0) for i in range(120)], True)
    assert few.host_read_count == many.host_read_count == 0, dict(many.host_reads)
    assert many.total <= few.total + 2, (few.top(10), many.top(10))
    checked = count([(f"t{i}", 500 + 7 * i, i % 3 != 0) for i in range(120)], False)
    assert checked.host_read_count == 1  # the bucket's finiteness, once


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["bucket", "substituted", "offloaded", "momentum", "no error feedback"])
def test_conservation_exact_and_what_each_member_sends_by_itself(vdtype: torch.dtype, variant: str) -> None:
    """Whatever the residuals' home and the inputs' source, the bucket at once sends, per member, the
    values at ``RandomK.select``'s coordinates of its own ``p = g + e``, and keeps exactly the rest."""
    plan, ks = _plan(), _ks(_plan(), 0.05)
    ctx = dataclasses.replace(
        _ctx(), momentum_correction=0.9 if variant == "momentum" else 0.0, error_feedback=variant != "no error feedback"
    )
    if variant == "offloaded":
        ctx.memory.home = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    residuals = {m.name: torch.zeros(m.numel) for m in plan.sparse_members}
    for step in range(4):
        buffer = torch.randn(plan.numel, generator=gen)
        sources = {}
        if variant in ("substituted", "momentum"):  # a float32 input beside the bucket (momentum correction's)
            for m in plan.sparse_members:
                sources[m.name] = ctx.velocity.update(m.name, buffer[m.offset : m.offset + m.numel] * 1.5, 0.9)
        call = BucketCall(buffer.clone(), plan, step, Counters(), inputs_finite=True, sources=sources)
        sources = {n: u.clone() for n, u in sources.items()}  # as they were sent (the momenta forget it)
        sel = shared.select_shared(ctx, call, ks, vdtype)
        got, alone = _by_name(plan, sel.coords), _per_tensor(ctx, plan, ks, step)
        pos = 0
        for i in SparseSpace.of(plan).members:
            m, k = plan.sparse_members[i], ks[i]
            g = sources.get(m.name, buffer[m.offset : m.offset + m.numel])
            p = g + residuals[m.name] if ctx.error_feedback else g
            sent = sel.sent[pos : pos + k]
            pos += k
            assert torch.equal(got[m.name], alone[m.name].sort().values)
            assert torch.equal(sent, p[got[m.name]].to(vdtype)), (step, m.name)
            if ctx.error_feedback:
                residuals[m.name] = p.clone()
                residuals[m.name][got[m.name]] -= sent.float()
                assert torch.equal(ctx.memory.get(m.name), residuals[m.name]), (step, m.name)
                e = ctx.memory.get(m.name).clone()
                e[got[m.name]] += sent.float()
                assert torch.equal(e, p)  # sent + e_new == p, exactly
            if variant == "momentum":
                assert (ctx.velocity.get(m.name)[got[m.name]] == 0).all()
        if variant == "offloaded":
            ctx.memory.unstage()  # as the exchange does after each step


def test_a_non_finite_member_sends_nan_at_the_same_coordinates_and_keeps_its_residual() -> None:
    plan, ks = _plan(), _ks(_plan())
    ctx = _ctx()
    shared.select_shared(ctx, BucketCall(torch.randn(plan.numel), plan, 0, Counters()), ks, torch.float32)
    bad = plan.sparse_members[1]
    before = {m.name: ctx.memory.get(m.name).clone() for m in plan.sparse_members}
    buffer = torch.randn(plan.numel)
    buffer[bad.offset + 3] = float("nan")
    counters = Counters()
    sel = shared.select_shared(ctx, BucketCall(buffer, plan, 1, counters), ks, torch.float32)
    clean = shared.select_shared(_ctx(), BucketCall(torch.randn(plan.numel), plan, 1, Counters()), ks, torch.float32)
    assert torch.equal(sel.coords, clean.coords)
    assert counters.nonfinite_buckets == 1
    got = _by_name(plan, sel.coords)
    space = SparseSpace.of(plan)
    pos = 0
    for i in space.members:
        m, k = plan.sparse_members[i], ks[i]
        values = sel.sent[pos : pos + k]
        pos += k
        if m is bad:
            assert values.isnan().all() and torch.equal(ctx.memory.get(m.name), before[m.name])
        else:
            assert torch.isfinite(values).all() and got[m.name].numel() == k
            assert (ctx.memory.get(m.name)[got[m.name]] == 0).all()


def test_without_error_feedback_sends_the_input() -> None:
    plan, ks = _plan(), _ks(_plan())
    ctx = dataclasses.replace(_ctx(), error_feedback=False)
    buffer = torch.randn(plan.numel)
    sel = shared.select_shared(ctx, BucketCall(buffer, plan, 2, Counters(), inputs_finite=True), ks, torch.bfloat16)
    at = SparseSpace.of(plan).to_bucket(sel.coords)
    assert torch.equal(sel.sent, buffer[at].to(torch.bfloat16)) and len(ctx.memory) == 0


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    named = [(n, torch.zeros(numel, requires_grad=True)) for n, numel, _ in SIZES]
    params = [p for _, p in named]
    state = SparseState(compressor="randomk", density=0.02, min_numel=100, warmup_steps=1, seed=5)
    state.bind(named)
    numel = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(rank)
    outs = []
    for step in range(3):
        g = torch.randn(numel, generator=gen)
        if rank == 1 and step == 2:
            g[7] = float("nan")  # the first member: sent as NaN at the coordinates both ranks pick
        outs.append(communicate(state, g, params).wait().clone())
    return {"outs": outs, "plan": state.plan(torch.zeros(numel), params)}


@pytest.mark.dist
def test_on_two_ranks_the_same_coordinates(dist2: Any) -> None:
    r0, r1 = dist2.run(_two_ranks)
    plan = r0["plan"]
    for step, (a, b) in enumerate(zip(r0["outs"], r1["outs"], strict=True)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), step  # identical bits, NaN included
        if step == 0:
            continue  # the dense warm-up
        ctx = dataclasses.replace(_ctx(), seed=5)
        for m in plan.sparse_members:
            sent = (a[m.offset : m.offset + m.numel] != 0).nonzero().squeeze(1)
            picks = RandomK().select(torch.empty(m.numel), max(1, round(0.02 * m.numel)), ctx.compress_context(step, m))
            assert sent.tolist() == picks.tolist(), (step, m.name)
