"""The count-sketch of a whole bucket at once (``lightning_sparse.wire.sketch``): the tables are each
member's count-sketch under the hashes the module describes, the candidates each member's top-``c``
estimates, the picks each member's ``k`` largest sums; conservation exactly; the same picks for the
same seed; a fixed number of operators and host reads whatever the number of tensors."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from test_batched import SIZES as BATCHED_SIZES
from test_batched import _plan as batched_plan

from lightning_sparse._utils import make_generator, mix_seed
from lightning_sparse.compressors import CountSketch
from lightning_sparse.wire import sketch
from lightning_sparse.wire.comm import Collectives, run
from lightning_sparse.wire.context import Average, BucketCall, BucketPlan, WireContext
from lightning_sparse.wire.memory import ErrorFeedback
from lightning_sparse.wire.patterns import PATTERNS
from lightning_sparse.wire.stats import Counters

CPU = torch.device("cpu")
#: (numel, sparse): test_batched's bucket with its largest tensor at 30,000 (below the CPU limit of
#: the sketch at once: rows * numel <= 2**20)
SIZES = [(30_000, True) if numel == 100_000 else (numel, sparse) for numel, sparse in BATCHED_SIZES]


def _plan(sizes: list[tuple[int, bool]] = SIZES) -> BucketPlan:
    return batched_plan(sizes)


def _ks(plan: BucketPlan, density: float = 0.01) -> list[int]:
    return [max(1, round(density * m.numel)) for m in plan.sparse_members]


def _ctx(compressor: CountSketch, seed: int = 0, error_feedback: bool = True, rank: int = 0) -> WireContext:
    return WireContext(
        compressor, error_feedback, 0.0, None, seed, "auto", True, None, True, memory=ErrorFeedback(), rank=rank
    )


def _exchange(
    ctx: WireContext, plan: BucketPlan, buffer: torch.Tensor, step: int, ks: list[int], inputs_finite: bool = True
) -> tuple[torch.Tensor, BucketCall]:
    """One exchange of the bucket on one process: what it adds into zeros (what this rank sent)."""
    call = BucketCall(buffer.clone(), plan, step, Counters(), inputs_finite=inputs_finite)
    assert sketch.eligible(ctx, call)
    pending = run(PATTERNS["sketch"].launch_rounds(ctx, call, ks))
    return Average(call.buffer, [pending]).add_to(torch.zeros(plan.numel)), call


def _residuals(ctx: WireContext, plan: BucketPlan) -> dict[str, torch.Tensor]:
    memory = ctx.memory
    return {
        m.name: (memory.get(m.name) if m.name in memory else torch.zeros(m.numel)).clone() for m in plan.sparse_members
    }


def _recorded(ctx: WireContext, monkeypatch: Any) -> list[torch.Tensor]:
    """The tensors handed to the all-reduces (one process: the summed tables are this rank's)."""
    handed: list[torch.Tensor] = []
    real = Collectives.all_reduce
    comm = ctx.comm

    def all_reduce(self: Collectives, t: torch.Tensor, counters: Any = None) -> Any:
        if self is comm:
            handed.append(t)
        return real(self, t, counters)

    monkeypatch.setattr(Collectives, "all_reduce", all_reduce)
    return handed


def _expected_tables(
    compressor: CountSketch, plan: BucketPlan, ks: list[int], layout: Any, x: torch.Tensor, seed: int, step: int
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tables as the module's docstring describes them, written out independently: per member and
    row, coordinate ``j`` goes to ``(j % cols + shift[r, b]) % cols`` with sign ``sign[r, b]``,
    ``b = j // cols``; one draw of every block's shift and sign for the bucket. Also each member's
    (bucket in the message, sign) per row and coordinate."""
    blocks = layout.block_of.max().item() + 1
    gen = make_generator(CPU, mix_seed(seed, sketch._HASH_TAG, step, layout.seed_key))
    draws = torch.randint(0, 1 << 62, (2, compressor.rows, blocks), generator=gen)
    expected = torch.zeros(layout.tables, dtype=torch.float64)
    hashes = []
    b0 = t0 = q0 = 0
    for m, k in zip(plan.sparse_members, ks, strict=True):
        rows, cols = compressor.table_shape(m.numel, k)
        j = torch.arange(m.numel)
        blk = b0 + j // cols
        where = torch.stack([t0 + r * cols + (j % cols + draws[0, r, blk] % cols) % cols for r in range(rows)])
        sign = 1 - 2 * (draws[1, :, blk] & 1)
        for r in range(rows):
            expected.index_add_(0, where[r], (sign[r] * x[q0 : q0 + m.numel]).double())
        hashes.append((where, sign.double()))
        b0, t0, q0 = b0 + math.ceil(m.numel / cols), t0 + rows * cols, q0 + m.numel
    return expected, hashes


def test_the_tables_are_each_members_count_sketch_under_one_draw_for_the_bucket() -> None:
    plan, compressor = _plan(), CountSketch(rows=3, width=4.0, p1=0)
    ks = _ks(plan)
    layout = sketch.SketchLayout.of(plan, tuple(ks), compressor, CPU)
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    tables = []
    for rank in (0, 1):  # the rank does not enter the hashes: every rank sketches into the same buckets
        t = torch.zeros(layout.tables)
        call = BucketCall(torch.zeros(plan.numel), plan, 4, Counters())
        sketch.sketch_tables(_ctx(compressor, seed=7, rank=rank), call, layout, x, t)
        tables.append(t)
    assert torch.equal(tables[0], tables[1])
    expected, hashes = _expected_tables(compressor, plan, ks, layout, x, seed=7, step=4)
    assert torch.allclose(tables[0].double(), expected, atol=1e-4)
    for (where, _), m, k in zip(hashes, plan.sparse_members, ks, strict=True):
        cols = compressor.table_shape(m.numel, k)[1]
        for row in where:  # no two coordinates of one block share a bucket
            assert row.view(-1)[: m.numel // cols * cols].view(-1, cols).sort(1).values.diff(dim=1).min() > 0


def test_the_candidates_are_each_members_top_c_estimates_and_the_picks_its_k_largest_sums(monkeypatch: Any) -> None:
    plan, compressor = _plan(), CountSketch(rows=5, width=3.0)
    ks = _ks(plan)
    ctx = _ctx(compressor, seed=2)
    buffer = torch.randn(plan.numel, generator=torch.Generator().manual_seed(4)) ** 3
    handed = _recorded(ctx, monkeypatch)
    found: list[torch.Tensor] = []
    original = sketch._candidates

    def candidates(*args: Any) -> torch.Tensor:
        found.append(original(*args))
        return found[-1].clone()

    monkeypatch.setattr(sketch, "_candidates", candidates)
    out, _ = _exchange(ctx, plan, buffer, 3, ks)
    tables, values = handed
    layout = sketch.SketchLayout.of(plan, tuple(ks), compressor, CPU)
    _, hashes = _expected_tables(compressor, plan, ks, layout, torch.zeros(layout.numel), seed=2, step=3)
    pos = q0 = 0
    for m, k, (where, sign) in zip(plan.sparse_members, ks, hashes, strict=True):
        c = compressor.num_candidates(m.numel, k)
        estimates = (tables.double()[where] * sign).median(0).values.abs()
        sums = values[pos : pos + c]
        # the candidates: this member's c largest estimates; their exact p travelled in round 2
        cand = found[0][pos : pos + c] - q0
        assert cand.unique().numel() == c and 0 <= int(cand.min()) and int(cand.max()) < m.numel
        assert torch.equal(sums, buffer[m.offset : m.offset + m.numel][cand])
        assert torch.equal(estimates[cand].sort().values, estimates.topk(c).values.sort().values)
        # the picks: its k largest |sums|, sent as they are
        sent = out[m.offset : m.offset + m.numel]
        assert int((sent != 0).sum()) == k
        assert torch.equal(sent[sent != 0].abs().sort().values, sums.abs().topk(k).values.sort().values)
        pos, q0 = pos + c, q0 + m.numel
    assert pos == values.numel() == layout.cand_member.numel()


@pytest.mark.parametrize("value_dtype", [None, torch.bfloat16])
def test_conservation_exactly_and_k_picks_per_member(value_dtype: torch.dtype | None) -> None:
    plan = _plan()
    ks = _ks(plan)
    ctx = _ctx(CountSketch())
    if value_dtype is not None:
        ctx = dataclasses.replace(ctx, value_dtype=value_dtype)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        buffer = torch.randn(plan.numel, generator=gen)
        before = _residuals(ctx, plan)
        out, call = _exchange(ctx, plan, buffer, step, ks, inputs_finite=step % 2 == 0)
        assert call.counters.sent_numel == sum(ks) and not call.counters.nonfinite_buckets
        after = _residuals(ctx, plan)
        for m, k in zip(plan.sparse_members, ks, strict=True):
            seg = slice(m.offset, m.offset + m.numel)
            assert int((out[seg] != 0).sum()) == k
            assert torch.equal(out[seg] + after[m.name], buffer[seg] + before[m.name]), (step, m.name)


def test_without_collisions_the_picks_are_the_exact_top_k() -> None:
    """With ``cols >= numel`` every member is one block: no collision, the estimates are exact."""
    plan = _plan([(3000, True), (64, False), (5000, True)])
    ks = [30, 50]
    ctx = _ctx(CountSketch(rows=3, width=1000.0, p1=0), error_feedback=False)
    buffer = torch.randn(plan.numel, generator=torch.Generator().manual_seed(5))
    out, _ = _exchange(ctx, plan, buffer, 1, ks)
    for m, k in zip(plan.sparse_members, ks, strict=True):
        seg = slice(m.offset, m.offset + m.numel)
        top = buffer[seg].abs().topk(k).indices
        assert torch.equal(out[seg].nonzero().view(-1), top.sort().values)
        assert torch.equal(out[seg][top], buffer[seg][top])
    assert len(ctx.memory) == 0


def test_the_same_seed_picks_the_same_and_another_seed_draws_other_hashes(monkeypatch: Any) -> None:
    plan = _plan()
    ks = _ks(plan)
    buffers = [torch.randn(plan.numel, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    runs = []
    for seed in (0, 0, 1):
        ctx = _ctx(CountSketch(), seed=seed)
        handed = _recorded(ctx, monkeypatch)
        outs = [_exchange(ctx, plan, b, step, ks)[0] for step, b in enumerate(buffers)]
        runs.append((outs, handed[0].clone(), _residuals(ctx, plan)))
    (a, ta, ea), (b, tb, eb), (_, tc, _) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(ta, tb) and all(torch.equal(ea[n], eb[n]) for n in ea)
    assert not torch.equal(ta, tc)


def test_a_shortlist_that_overflows_finds_the_same_candidates_one_member_at_a_time(monkeypatch: Any) -> None:
    plan = _plan()
    ks = _ks(plan)
    buffer = torch.randn(plan.numel, generator=torch.Generator().manual_seed(6))
    calls: list[int] = []
    original = sketch._candidates_one_by_one
    monkeypatch.setattr(sketch, "_candidates_one_by_one", lambda *a: calls.append(1) or original(*a))
    fast, _ = _exchange(_ctx(CountSketch()), plan, buffer, 2, ks)
    assert calls == []
    layout = sketch.SketchLayout.of(plan, tuple(ks), CountSketch(), CPU)
    monkeypatch.setattr(layout, "capacity", layout.cand_member.numel() // 2)
    slow, _ = _exchange(_ctx(CountSketch()), plan, buffer, 2, ks)
    assert calls == [1]
    assert torch.equal(fast, slow)


def test_an_idle_member_takes_k_coordinates_without_the_fallback(monkeypatch: Any) -> None:
    """Its estimates are all zero: its threshold is 0, and its first c coordinates fill its candidates."""
    plan = _plan()
    ks = _ks(plan)
    calls: list[int] = []
    original = sketch._candidates_one_by_one
    monkeypatch.setattr(sketch, "_candidates_one_by_one", lambda *a: calls.append(1) or original(*a))
    ctx = _ctx(CountSketch())
    buffer = torch.randn(plan.numel, generator=torch.Generator().manual_seed(8))
    idle = plan.sparse_members[2]
    buffer[idle.offset : idle.offset + idle.numel] = 0.0
    handed = _recorded(ctx, monkeypatch)
    out, _ = _exchange(ctx, plan, buffer, 1, ks)
    assert calls == []
    assert handed[1].numel() == sketch.SketchLayout.of(plan, tuple(ks), CountSketch(), CPU).cand_member.numel()
    after = _residuals(ctx, plan)
    for m in plan.sparse_members:
        seg = slice(m.offset, m.offset + m.numel)
        assert torch.equal(out[seg] + after[m.name], buffer[seg])


def test_a_non_finite_member_sends_nan_and_keeps_its_residual() -> None:
    plan = _plan()
    ks = _ks(plan)
    ctx = _ctx(CountSketch())
    gen = torch.Generator().manual_seed(9)
    _exchange(ctx, plan, torch.randn(plan.numel, generator=gen), 0, ks)
    before = _residuals(ctx, plan)
    buffer = torch.randn(plan.numel, generator=gen)
    bad = plan.sparse_members[1]
    buffer[bad.offset + 3] = float("inf")
    out, call = _exchange(ctx, plan, buffer, 1, ks, inputs_finite=False)
    assert call.counters.nonfinite_buckets == 1
    after = _residuals(ctx, plan)
    assert torch.equal(after[bad.name], before[bad.name])
    assert int(out[bad.offset : bad.offset + bad.numel].isnan().sum()) == ks[1]
    for m in plan.sparse_members:
        if m is not bad:
            seg = slice(m.offset, m.offset + m.numel)
            assert torch.equal(out[seg] + after[m.name], buffer[seg] + before[m.name])


def test_a_large_tensor_on_a_cpu_and_momentum_correction_keep_the_per_tensor_path() -> None:
    plan = _plan([(400_000, True), (5000, True)])
    call = BucketCall(torch.zeros(plan.numel), plan, 0, Counters())
    assert not sketch.eligible(_ctx(CountSketch(rows=3)), call)  # 3 * 400k > CPU_ONE_BY_ONE
    assert sketch.eligible(_ctx(CountSketch(rows=1)), call)
    assert not sketch.eligible(dataclasses.replace(_ctx(CountSketch(rows=1)), momentum_correction=0.9), call)


def _counted(plan: BucketPlan, inputs_finite: bool) -> tuple[int, int]:
    from benchmarks.opcount import OpCounter

    ks = _ks(plan)
    ctx = _ctx(CountSketch())
    gen = torch.Generator().manual_seed(0)
    _exchange(ctx, plan, torch.randn(plan.numel, generator=gen), 0, ks)  # the first: layouts, flat residual
    ops = OpCounter()
    with ops:
        _exchange(ctx, plan, torch.randn(plan.numel, generator=gen), 1, ks, inputs_finite=inputs_finite)
    return ops.total, ops.host_read_count


@pytest.mark.parametrize("inputs_finite", [True, False], ids=["update mode", "gradient mode"])
def test_operators_and_host_reads_do_not_grow_with_the_tensors(inputs_finite: bool) -> None:
    few = _plan([(24_000, True)] * 4)
    many = _plan([(2_000, True), (400, True)] * 40)
    assert few.numel == many.numel
    (ops_few, reads_few), (ops_many, reads_many) = (_counted(p, inputs_finite) for p in (few, many))
    assert ops_many == ops_few, (ops_many, ops_few)
    assert reads_many == reads_few == (1 if inputs_finite else 2)


# ---------------------------------------------------------------------------- 2 ranks
SHAPES = {"a.weight": (40, 50), "a.bias": (40,), "b.weight": (3000,), "c.weight": (64, 64), "c.bias": (7,)}


def _gradient_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from test_hook_dist import capture_collectives

    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    named = [(n, torch.zeros(s, requires_grad=True)) for n, s in SHAPES.items()]
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    # update mode's buckets keep their members: there the bucket is sketched at once (in gradient mode
    # DDP lays its buckets out anew, and the sketch goes one tensor at a time)
    state = SparseState(
        compressor=CountSketch(rows=3, width=4.0),
        density=0.02,
        min_numel=1000,
        warmup_steps=1,
        seed=5,
        compress="update",
    )
    state.bind(named)
    gen = torch.Generator().manual_seed(100 + rank)
    outs = []
    with capture_collectives() as captured:
        for step in range(4):
            captured.clear()
            g = torch.randn(numel, generator=gen) * (1 + step)
            plan = state.plan(g, params)
            old = _residuals(state.wire, plan)
            out = communicate(state, g.clone(), params, is_last=True).wait().clone()
            outs.append(out)
            if step < 1:
                continue
            ks = [max(1, round(0.02 * m.numel)) for m in plan.sparse_members]
            new = _residuals(state.wire, plan)
            sent = torch.zeros(numel)
            for m in plan.sparse_members:
                seg = slice(m.offset, m.offset + m.numel)
                sent[seg] = g[seg] + old[m.name] - new[m.name]  # conservation: what left the residual
            # round 1 carries this rank's sketch of p
            layout = sketch.SketchLayout.of(plan, tuple(ks), state.compressor, CPU)
            x = torch.cat([g[m.offset : m.offset + m.numel] + old[m.name] for m in plan.sparse_members])
            tables = torch.zeros(layout.tables)
            call = BucketCall(g, plan, state.step - 1, Counters())
            sketch.sketch_tables(state.wire, call, layout, x, tables)
            assert torch.equal(captured[0][1][: layout.tables], tables), step
            # every rank keeps the same k coordinates per member, and the output is the mean of what they sent
            everyone = [torch.empty_like(sent) for _ in range(world)]
            dist.all_gather(everyone, sent)
            picked = [s != 0 for s in everyone]
            assert torch.equal(picked[0], picked[1])
            for m, k in zip(plan.sparse_members, ks, strict=True):
                assert int(picked[0][m.offset : m.offset + m.numel].sum()) == k
            sparse = torch.cat([torch.arange(m.offset, m.offset + m.numel) for m in plan.sparse_members])
            assert torch.equal(out[sparse], (torch.stack(everyone).sum(0) / world)[sparse])
    return {"outs": outs, "methods": list(state.telemetry.methods)}


@pytest.mark.dist
def test_on_two_ranks_the_same_coordinates_and_the_mean_of_what_was_sent(dist2: Any) -> None:
    results = dist2.run(_gradient_worker)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["outs"], results[1]["outs"], strict=True))
    assert "countsketch" in results[0]["methods"]


def test_gradient_buckets_are_sketched_one_tensor_at_a_time() -> None:
    """DDP lays its gradient buckets out anew after its first step and on resume: hashes drawn per
    bucket would change a resumed run's picks, so gradient mode keeps the per-tensor sketch."""
    from lightning_sparse.config import SparseConfig
    from lightning_sparse.wire.context import wire_context

    plan = _plan()
    call = BucketCall(torch.zeros(plan.numel), plan, 0, Counters())
    for compress, at_once in (("update", True), ("gradient", False)):
        ctx = wire_context(SparseConfig(compressor=CountSketch(rows=3), compress=compress))
        assert sketch.eligible(ctx, call) is at_once
