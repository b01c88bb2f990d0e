"""The hook on 2 real gloo processes, with the messages read off the wire.

Every collective's input is captured; the test decodes what this rank actually sent and checks:
- conservation, bit for bit: sent + new residual == gradient + old residual, every parameter;
- the output is the average over ranks of what each rank sent, and identical on all ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.dist

# d.weight is large enough for the count-sketch's blockwise paths (rows * numel above its direct-path limit)
SHAPES = {
    "a.weight": (40, 50),
    "a.bias": (40,),
    "b.weight": (3000,),
    "c.weight": (64, 64),
    "c.bias": (7,),
    "d.weight": (600, 600),
}


def _params(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.zeros(s, dtype=dtype, requires_grad=True)) for n, s in SHAPES.items()]


def _decode(
    captured: list[tuple[str, torch.Tensor, torch.Tensor]],
    state: Any,
    step: int,
    plan: Any,
    ks: list[int],
    numel: int,
    captured_dtype: torch.dtype,
) -> torch.Tensor:
    """What this rank sent, as a dense float32 vector in bucket layout, read from the messages.

    ``captured`` holds ``(kind, input as sent, the collective's output tensor)`` per collective.
    """
    from lightning_sparse.compressors import CompressContext

    sent = torch.zeros(numel, dtype=torch.float32)
    kind, first, _ = captured[0]
    if len(captured) == 1 and kind == "reduce" and first.numel() == numel:  # dense bucket
        return first.float()
    sparse, dense = plan.sparse_members, plan.dense_members
    total_k = sum(ks)
    vdtype = state.config.value_dtype or captured_dtype
    compressor = state.compressor
    reduced = _Reduced(captured)
    if kind == "gather":
        from lightning_sparse.wire import MessageLayout, SparseSpace

        space = SparseSpace.of(plan)
        layout = MessageLayout(space.numel, total_k, vdtype, state.config.compact_indices)
        assert first.numel() == layout.size
        coords, vals = layout.unpack(first)
        assert bool((coords[1:] > coords[:-1]).all()), "coordinates travel sorted"
        idx, vals = space.to_bucket(coords), vals.float()
        assert idx.unique().numel() == total_k, "indices must be unique"
        assert int(idx.min()) >= 0 and int(idx.max()) < numel
        sent[idx] = vals
    elif compressor.pattern == "sketch":
        # round 1: the tables (summed on the wire); round 2: exact values at the candidates
        shapes = [compressor.table_shape(m.numel, k) for m, k in zip(sparse, ks, strict=True)]
        _, tables = reduced.take(sum(r * c for r, c in shapes), torch.float32)
        counts = [compressor.num_candidates(m.numel, k) for m, k in zip(sparse, ks, strict=True)]
        mine, sums = reduced.take(sum(counts), vdtype)
        pos_t = pos_v = 0
        for m, k, (rows, cols) in zip(sparse, ks, shapes, strict=True):
            table = tables[pos_t : pos_t + rows * cols].view(rows, cols)
            ctx = CompressContext(step=step, key=m.key, rank=state.rank, world_size=2, seed=state.config.seed)
            cand = compressor.candidates(table, m.numel, k, ctx)
            n = cand.numel()
            assert n == compressor.num_candidates(m.numel, k) and cand.unique().numel() == n
            chosen = torch.topk(sums[pos_v : pos_v + n].float().abs(), k).indices
            sent[m.offset + cand[chosen]] = mine[pos_v : pos_v + n][chosen].float()
            pos_t += rows * cols
            pos_v += n
        assert pos_t == tables.numel() and pos_v == mine.numel()
    else:  # shared: the indices are never sent; every rank derives them from the shared seed
        from lightning_sparse.wire import SparseSpace

        first, _ = reduced.take(total_k, vdtype)
        vals = first.float()
        pos = 0
        for i in SparseSpace.of(plan).members:  # the values travel by tensor name, coordinates ascending
            m, k = sparse[i], ks[i]
            ctx = CompressContext(step=step, key=m.key, rank=state.rank, world_size=2, seed=state.config.seed)
            idx = compressor.select(torch.zeros(m.numel), k, ctx).sort().values
            sent[m.offset + idx] = vals[pos : pos + k]
            pos += k
    if dense:
        dvals, _ = reduced.take(sum(m.numel for m in dense))
        dvals = dvals.float()
        pos = 0
        for m in dense:
            sent[m.offset : m.offset + m.numel] = dvals[pos : pos + m.numel]
            pos += m.numel
    assert reduced.done(), "every all-reduce's input is accounted for"
    return sent


class _Reduced:
    """The captured all-reduces' (input as sent, output) read as consecutive parts: the exchange
    coalesces the calls of a step, so one all-reduce may carry several parts (the sparse values
    and the small tensors beside them, say)."""

    def __init__(self, captured: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        self.parts = [(inp.reshape(-1), out.reshape(-1)) for kind, inp, out in captured if kind == "reduce"]
        self.i = self.pos = 0

    def take(self, n: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.i < len(self.parts), f"expected an all-reduce of {n} more values"
        inp, out = self.parts[self.i]
        assert self.pos + n <= inp.numel(), f"an all-reduce of {inp.numel()} values cannot hold {n} more"
        assert dtype is None or inp.dtype == dtype, f"values travel as {inp.dtype}, expected {dtype}"
        got = inp[self.pos : self.pos + n], out[self.pos : self.pos + n]
        self.pos += n
        if self.pos == inp.numel():
            self.i, self.pos = self.i + 1, 0
        return got

    def done(self) -> bool:
        return self.i == len(self.parts)


@contextlib.contextmanager
def capture_collectives() -> Iterator[list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """Record ``(kind, input as sent, the collective's output tensor)`` of every collective the
    package issues through :mod:`lightning_sparse.wire.comm` inside the block."""
    from lightning_sparse.wire import comm

    captured: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    real_gather, real_reduce, real_alltoall = comm.all_gather, comm.all_reduce, comm.all_to_all

    def gather(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
        captured.append(("gather", inp.clone(), out))
        return real_gather(out, inp, group)

    def reduce(t: torch.Tensor, group: Any = None) -> Any:
        captured.append(("reduce", t.clone(), t))
        return real_reduce(t, group)

    def alltoall(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
        captured.append(("alltoall", inp.clone(), out))
        return real_alltoall(out, inp, group)

    comm.all_gather, comm.all_reduce, comm.all_to_all = gather, reduce, alltoall
    try:
        yield captured
    finally:
        comm.all_gather, comm.all_reduce, comm.all_to_all = real_gather, real_reduce, real_alltoall


def _check_sketch_tables(state: Any, captured: list, step: int, plan: Any, ks: list[int], ps: dict) -> None:
    """Round 1 carries this rank's count-sketch of p, exactly as the compressor computes it."""
    from lightning_sparse.compressors import CompressContext

    mine = captured[0][1]
    pos = 0
    for m, k in zip(plan.sparse_members, ks, strict=True):
        shape = state.compressor.table_shape(m.numel, k)
        table = torch.zeros(shape)
        ctx = CompressContext(step=step, key=m.key, rank=state.rank, world_size=2, seed=state.config.seed)
        state.compressor.sketch(ps[m.name], k, ctx, table)
        assert torch.equal(mine[pos : pos + table.numel()], table.view(-1)), f"{m.name}: round 1 is not the sketch"
        pos += table.numel()


def _conservation_worker(
    rank: int,
    world: int,
    compressor: Any,
    value_dtype: str | None,
    grad_dtype: str,
    error_feedback: bool,
    steps: int = 4,
) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    dtype = getattr(torch, grad_dtype)
    named = _params(dtype)
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    state = SparseState(
        compressor=compressor,
        density=0.02,
        min_numel=1000,
        warmup_steps=1,
        value_dtype=value_dtype,
        error_feedback=error_feedback,
        fallback_to_dense=False,
        seed=5,
    )
    state.bind(named)

    gen = torch.Generator().manual_seed(100 + rank)
    checked_sparse_steps = 0
    with capture_collectives() as captured:
        for step in range(steps):
            g = (torch.randn(numel, generator=gen) * (1 + step)).to(dtype)
            plan = state.plan(g, params)
            old = {m.name: state.memory.get(m.name).clone() for m in plan.members if m.name in state.memory}
            ks = [state.compressor.k_for(m.numel, 0.02) for m in plan.sparse_members]  # the compressor's count
            captured.clear()
            ps = {
                m.name: g[m.offset : m.offset + m.numel].float() + old[m.name]
                if m.name in old
                else g[m.offset : m.offset + m.numel].float()
                for m in plan.sparse_members
            }
            if not error_feedback:  # p is the gradient itself, in its own dtype
                ps = {m.name: g[m.offset : m.offset + m.numel] for m in plan.sparse_members}
            out = communicate(state, g.clone(), params, is_last=True).wait()
            sent = _decode(captured, state, step, plan, ks, numel, dtype)
            sparse_step = step >= state.config.warmup_steps
            if sparse_step and state.compressor.pattern == "sketch":
                _check_sketch_tables(state, captured, step, plan, ks, ps)
            checked_sparse_steps += sparse_step
            for m in plan.members:
                seg = slice(m.offset, m.offset + m.numel)
                p = g[seg].float() + old[m.name] if m.name in old else g[seg].float()
                if not error_feedback:
                    assert m.name not in state.memory
                    if m.sparse and sparse_step:
                        nz = sent[seg] != 0
                        assert torch.equal(sent[seg][nz], g[seg][nz].to(state.config.value_dtype or dtype).float())
                    continue
                new = state.memory.get(m.name) if m.name in state.memory else torch.zeros(m.numel)
                # conservation, exactly: sent + e_new == g + e_old
                assert torch.equal(sent[seg] + new, p), f"step {step} {m.name}: conservation broken"
                if m.sparse and sparse_step:
                    assert int((sent[seg] != 0).sum()) <= state.compressor.k_for(m.numel, 0.02)
            # the output is the mean of what the ranks sent, bit-identical on every rank
            everyone = [torch.empty_like(sent) for _ in range(world)]
            dist.all_gather(everyone, sent)
            expected = torch.stack(everyone).sum(0) / world
            got = out.float()
            if value_dtype is None and grad_dtype == "float32":
                assert torch.equal(got, expected)
            else:
                assert torch.allclose(got, expected.to(dtype).float(), rtol=2e-2, atol=1e-2)
            outs = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(outs, got)
            assert torch.equal(outs[0], outs[1]), "replicas received different gradients"
    return {"sparse_steps": checked_sparse_steps, "telemetry": state.telemetry.total.as_dict()}


def _compressor(name: str) -> Any:
    """The compressors on the wire; count-sketch narrow enough to send fewer bytes than dense."""
    from lightning_sparse.compressors import CountSketch

    if name == "countsketch":  # p1="auto": local pre-truncation on CPU
        return CountSketch(rows=3, width=4.0)
    if name == "countsketch_p1_0":  # the whole of p sketched
        return CountSketch(rows=3, width=4.0, p1=0)
    return name


COMPRESSORS_ON_THE_WIRE = [
    "topk",
    "randomk",
    "rtopk",
    "gaussiank",
    "dgc",
    "randomblock",
    "countsketch",
    "countsketch_p1_0",
]
CASES = [(c, None, "float32") for c in COMPRESSORS_ON_THE_WIRE]
CASES += [(c, v, "float32") for c in COMPRESSORS_ON_THE_WIRE for v in ("float16", "bfloat16")]
CASES += [(c, None, "bfloat16") for c in ("topk", "randomk", "rtopk", "gaussiank", "dgc", "randomblock", "countsketch")]


@pytest.mark.parametrize("compressor,value_dtype,grad_dtype", CASES)
def test_conservation_and_average_on_the_wire(dist2, compressor, value_dtype, grad_dtype) -> None:
    results = dist2.run(
        _conservation_worker,
        compressor=_compressor(compressor),
        value_dtype=value_dtype,
        grad_dtype=grad_dtype,
        error_feedback=True,
    )
    assert results[0]["sparse_steps"] == 3
    t = results[0]["telemetry"]
    assert t["buckets"] == 4 and t["dense_buckets"] == 1
    assert t["sent_bytes"] < t["dense_bytes"]


@pytest.mark.parametrize("compressor", COMPRESSORS_ON_THE_WIRE)
def test_without_error_feedback_sends_p_and_keeps_nothing(dist2, compressor) -> None:
    results = dist2.run(
        _conservation_worker,
        compressor=_compressor(compressor),
        value_dtype=None,
        grad_dtype="float32",
        error_feedback=False,
    )
    assert results[1]["sparse_steps"] == 3


def _fallback_worker(rank: int, world: int, density: float, compact_indices: bool = False) -> dict[str, Any]:
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    named = _params(torch.float32)
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    state = SparseState(
        compressor="topk", density=density, min_numel=1000, warmup_steps=1, compact_indices=compact_indices
    )
    state.bind(named)
    g = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        out = communicate(state, g.clone(), params).wait()
    return {"telemetry": state.telemetry.total.as_dict(), "out": out}


def test_dense_fallback_when_sparse_moves_more_bytes(dist2) -> None:
    # density 0.6 with 8-byte (value, index) pairs gathered from 2 ranks moves more than dense
    r = dist2.run(_fallback_worker, density=0.6)
    t = r[0]["telemetry"]
    assert t["fallback_buckets"] == 2 and t["dense_buckets"] == 3
    assert t["sent_bytes"] == t["dense_bytes"]
    g0 = torch.randn(r[0]["out"].numel(), generator=torch.Generator().manual_seed(0))
    g1 = torch.randn(r[0]["out"].numel(), generator=torch.Generator().manual_seed(1))
    assert torch.equal(r[0]["out"], (g0 + g1) / 2) and torch.equal(r[1]["out"], r[0]["out"])
    r = dist2.run(_fallback_worker, density=0.01)
    assert r[0]["telemetry"]["fallback_buckets"] == 0
    # with compact indices (at density 0.6 about 1.7 bits each) the same message is smaller than dense
    r = dist2.run(_fallback_worker, density=0.6, compact_indices=True)
    t = r[0]["telemetry"]
    assert t["fallback_buckets"] == 0 and t["sent_bytes"] < t["dense_bytes"]


def _timed_fallback_worker(rank: int, world: int, slow: str) -> dict[str, Any]:
    """12 steps with a timed fallback (trial of 3 + 3 steps) while one way of sending is made slow
    for real: a sleep in the compressor's selection (sparse) or before a dense bucket's all-reduce."""
    import time

    from lightning_sparse.compressors import TopK
    from lightning_sparse.exchange.fallback import TimedFallback
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.wire import comm

    class SlowTopK(TopK):
        def select(self, p: torch.Tensor, k: int, ctx: Any) -> torch.Tensor:
            time.sleep(0.02)
            return super().select(p, k, ctx)

    named = _params(torch.float32)
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    real_all_reduce = comm.all_reduce

    def slow_all_reduce(t: torch.Tensor, group: Any = None) -> Any:
        if t.numel() == numel:  # a whole bucket sent dense; well above the sparse way's own time on a busy machine
            time.sleep(0.15)
        return real_all_reduce(t, group)

    state = SparseState(
        compressor=SlowTopK() if slow == "sparse" else TopK(),
        density=0.05,
        min_numel=1000,
        fallback_to_dense=TimedFallback(trial_steps=3),
    )
    state.bind(named)
    gen = torch.Generator().manual_seed(rank)
    methods, outs = [], []
    if slow == "dense":
        comm.all_reduce = slow_all_reduce
    try:
        for _ in range(12):
            before = {k: v.buckets for k, v in state.telemetry.methods.items()}
            outs.append(communicate(state, torch.randn(numel, generator=gen), params).wait().clone())
            after = {k: v.buckets for k, v in state.telemetry.methods.items()}
            methods.append([k for k in after if after[k] != before.get(k, 0)])
    finally:
        comm.all_reduce = real_all_reduce
    return {"methods": methods, "outs": outs, "fallback": state.timed_fallback.state_dict()}


@pytest.mark.parametrize("slow", ["sparse", "dense"])
def test_timed_fallback_keeps_the_faster_way_on_every_rank(dist2, slow: str) -> None:
    r = dist2.run(_timed_fallback_worker, slow=slow)
    chosen = "dense" if slow == "sparse" else "sparse"
    sparse_name = "topk"  # SlowTopK keeps its parent's name
    after = ["dense (timed fallback)"] if chosen == "dense" else [sparse_name]
    # warm-up, 3 dense trial steps, 3 sparse ones; the choice from step 7 on
    expected = [["dense (warm-up)"]] + [["dense (timing trial)"]] * 3 + [[sparse_name]] * 3 + [after] * 5
    for rank in range(2):
        assert r[rank]["methods"] == expected, rank
    # the same numbers (the slowest rank's medians) and so the same choice everywhere
    assert r[0]["fallback"] == r[1]["fallback"]
    (decision,) = r[0]["fallback"]["decisions"]
    assert decision["step"] == 7 and decision["choice"] == chosen
    slower, faster = (decision["sparse_s"], decision["dense_s"])[:: 1 if slow == "sparse" else -1]
    assert slower > faster + 0.015
    for a, b in zip(r[0]["outs"], r[1]["outs"], strict=True):
        assert torch.equal(a, b)
