"""Chunked top-k (``ChunkTopK``): the top of every row of ``chunk`` values, its count, and the exchange."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse import SparseConfig, SparseDDPStrategy, SparseState, exchange_cost
from lightning_sparse.compressors import (
    COMPRESSORS,
    ChunkTopK,
    CompressContext,
    TopK,
    get_compressor,
    k_for,
)
from lightning_sparse.compressors.chunktopk import RowLayout, tail_count
from lightning_sparse.exchange.hook import communicate

CTX = CompressContext(step=3, key=11, rank=0, world_size=2, seed=5)


def rows_of(n: int, chunk: int) -> list[slice]:
    return [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def assert_top_of_each_row(p: torch.Tensor, idx: torch.Tensor, chunk: int, counts: list[int]) -> None:
    """``idx`` holds ``counts[r]`` coordinates of row ``r``, each row's largest ``|p|`` (ties either way)."""
    a = p.abs()
    for r, (row, c) in enumerate(zip(rows_of(p.numel(), chunk), counts, strict=True)):
        mine = idx[(idx >= row.start) & (idx < row.stop)]
        assert mine.numel() == c, f"row {r}: {mine.numel()} picks, expected {c}"
        ref = torch.topk(a[row].float(), c).values.sort().values
        assert torch.equal(a[mine].float().sort().values, ref), f"row {r}: not its top {c}"


def expected_counts(n: int, chunk: int, density: float) -> list[int]:
    """The count per row ChunkTopK.k_for declares, written out: round(density * chunk) per full
    row, the last row its share, a tensor of at most one chunk as top-k."""
    if n <= chunk:
        return [k_for(n, density)]
    per_row = max(1, round(density * chunk))
    tail = n - (len(rows_of(n, chunk)) - 1) * chunk
    return [per_row] * (len(rows_of(n, chunk)) - 1) + [max(1, min(tail, round(per_row * tail / chunk)))]


# --------------------------------------------------------------------------- the selection
@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 127, 128, 129, 1000, 6401])
@pytest.mark.parametrize("density", [0.01, 0.1, 0.5, 1.0])
def test_each_row_sends_its_own_top(n: int, density: float) -> None:
    chunk = 64
    compressor = ChunkTopK(chunk=chunk)
    counts = expected_counts(n, chunk, density)
    k = compressor.k_for(n, density)
    assert k == sum(counts) and 1 <= k <= n
    p = torch.randn(n, generator=torch.Generator().manual_seed(n))
    idx = compressor.select(p, k, CTX)
    assert idx.dtype == torch.long and idx.shape == (k,)
    assert idx.unique().numel() == k
    assert int(idx.min()) >= 0 and int(idx.max()) < n
    assert_top_of_each_row(p, idx, chunk, counts)


def test_sizes_not_divisible_by_the_chunk_and_the_default_chunk() -> None:
    compressor = ChunkTopK()
    assert compressor.chunk == 4096
    for n, k in ((4096, 41), (4097, 42), (8000, 41 + 39), (100_000, 24 * 41 + 17)):
        assert compressor.k_for(n, 0.01) == k == sum(expected_counts(n, 4096, 0.01))
    p = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    idx = compressor.select(p, compressor.k_for(100_000, 0.01), CTX)
    assert_top_of_each_row(p, idx, 4096, expected_counts(100_000, 4096, 0.01))


def test_a_tensor_of_one_chunk_or_less_is_one_row_as_topk() -> None:
    compressor = ChunkTopK(chunk=4096)
    for n in (10, 1000, 4096):
        for density in (0.001, 0.01, 0.3):
            assert compressor.k_for(n, density) == TopK().k_for(n, density) == k_for(n, density)
    p = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    got = compressor.select(p, 30, CTX)
    assert set(got.tolist()) == set(TopK(fast=False).select(p, 30, CTX).tolist())


def test_padding_is_never_picked() -> None:
    """The last row's padding ranks below every value, zeros included, whatever ``k`` is asked."""
    chunk, n = 64, 3 * 64 + 5
    compressor = ChunkTopK(chunk=chunk)
    for p in (torch.zeros(n), torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-30):
        for k in range(1, n):
            idx = compressor.select(p, k, CTX)
            assert idx.numel() == k and idx.unique().numel() == k, k
            assert int(idx.max()) < n, f"k={k}: a padded position was picked"
    # the last row is small: it sends its own share, all of it real values
    p = torch.randn(n, generator=torch.Generator().manual_seed(3))
    p[-5:] = 0.0
    k = compressor.k_for(n, 0.5)
    assert expected_counts(n, chunk, 0.5) == [32, 32, 32, 2]
    idx = compressor.select(p, k, CTX)
    assert int((idx >= 3 * chunk).sum()) == 2 and int(idx.max()) < n


def test_any_k_is_spread_over_the_rows() -> None:
    """A ``k`` that ``k_for`` does not give (a direct call): every row takes its own top, the rows
    differing by at most one, none above its size."""
    chunk, n = 100, 1050
    compressor = ChunkTopK(chunk=chunk)
    p = torch.randn(n, generator=torch.Generator().manual_seed(4))
    for k in (1, 5, 10, 11, 12, 333, 1049):
        layout = RowLayout.of(n, k, chunk, torch.device("cpu"))
        counts = list(layout.counts)
        assert sum(counts) == k and max(counts[:-1]) - min(counts[:-1]) <= 1 and counts[-1] <= 50
        idx = compressor.select(p, k, CTX)
        assert idx.numel() == k and idx.unique().numel() == k
        assert_top_of_each_row(p, idx, chunk, counts)
    assert compressor.select(p, n, CTX).tolist() == list(range(n))
    assert compressor.select(p, 0, CTX).numel() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    chunk, n = 256, 5 * 256 + 77
    compressor = ChunkTopK(chunk=chunk)
    p = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(dtype)
    k = compressor.k_for(n, 0.05)
    idx = compressor.select(p, k, CTX)
    assert idx.shape == (k,) and idx.unique().numel() == k and int(idx.max()) < n
    assert_top_of_each_row(p, idx, chunk, expected_counts(n, chunk, 0.05))


def test_one_topk_and_no_host_read() -> None:
    from benchmarks.opcount import OpCounter

    compressor = ChunkTopK(chunk=512)
    for n, k in ((512 * 40, None), (512 * 40 + 33, None), (512 * 40 + 33, 777)):
        p = torch.randn(n, generator=torch.Generator().manual_seed(6))
        k = compressor.k_for(n, 0.02) if k is None else k
        compressor.select(p, k, CTX)  # the layout, made once per sizes
        with OpCounter() as ops:
            compressor.select(p, k, CTX)
        assert ops.host_read_count == 0, dict(ops.host_reads)
        assert ops.ops["aten::topk"] == 1, ops.top(10)
        assert ops.total <= 10, ops.top(10)  # views and slices included


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20_000), st.floats(0.0001, 1.0), st.integers(2, 5000))
def test_the_declared_count_is_what_is_picked(n: int, density: float, chunk: int) -> None:
    compressor = ChunkTopK(chunk=chunk)
    k = compressor.k_for(n, density)
    assert k == sum(expected_counts(n, chunk, density)) and 1 <= k <= n
    p = torch.randn(n, generator=torch.Generator().manual_seed(n + chunk))
    idx = compressor.select(p, k, CTX)
    assert idx.shape == (k,) and idx.unique().numel() == k and 0 <= int(idx.min()) and int(idx.max()) < n


def test_tail_count() -> None:
    assert [tail_count(41, r, 4096) for r in (1, 50, 51, 2048, 4096)] == [1, 1, 1, 20, 41]
    assert tail_count(0, 100, 4096) == 0


# --------------------------------------------------------------------------- arguments and names
@pytest.mark.parametrize(
    "chunk,match",
    [
        (1, r"chunk=1 is not allowed: expected an integer >= 2"),
        (0, r"chunk=0 is not allowed: expected an integer >= 2"),
        (64.0, r"chunk=64.0 is not allowed: expected an integer"),
        (True, r"chunk=True is not allowed: expected an integer"),
        ("4096", r"chunk='4096' is not allowed: expected an integer"),
    ],
)
def test_bad_chunk_is_refused(chunk: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ChunkTopK(chunk=chunk)


def test_registered_and_selectable_in_the_strategy() -> None:
    assert COMPRESSORS["chunk_topk"] is ChunkTopK and ChunkTopK.pattern == "gather"
    assert get_compressor("chunk_topk") == ChunkTopK()
    assert SparseDDPStrategy(compressor="chunk_topk").sparse_state.compressor == ChunkTopK(chunk=4096)
    given = ChunkTopK(chunk=1024)
    assert SparseDDPStrategy(compressor=given, density=0.01).sparse_state.compressor.config() == {"chunk": 1024}
    assert repr(given) == "ChunkTopK(chunk=1024)" and given != ChunkTopK() and given != TopK()
    assert not any(given.selects_at_once(rule) for rule in ("topk", "randomk", "countsketch"))
    given.ks_for((5000, 300), 0.01)  # kept answers do not travel
    copy = pickle.loads(pickle.dumps(given))
    assert copy == given and "_ks_memo" not in copy.__dict__
    config = SparseConfig(compressor="chunk_topk", value_bits=2, compact_indices=True)
    assert config.compressor == ChunkTopK()


def test_exchange_cost_counts_the_declared_coordinates() -> None:
    """The byte models see the compressor's count: an all-gather of its k values and indices."""
    from lightning_sparse.wire import MessageLayout, ring_all_gather_bytes

    numels = [4097 * 10, 100_000]
    config = SparseConfig(compressor=ChunkTopK(), density=0.01, compact_indices=False)
    k = sum(ChunkTopK().k_for(n, 0.01) for n in numels)
    assert k != sum(k_for(n, 0.01) for n in numels)
    expected = ring_all_gather_bytes(2, MessageLayout(sum(numels), k, torch.float32, False).size)
    assert exchange_cost(config, numels, world_size=2) == (expected, "allgather")


# --------------------------------------------------------------------------- error feedback, one process
SIZES = {"w": 6000, "v": 2 * 512 + 3, "b": 40, "u": 512}


@pytest.mark.parametrize(
    "grad_dtype,value_bits,compact",
    [("float32", None, True), ("float32", None, False), ("bfloat16", None, True)]
    + [("float32", bits, compact) for bits in (2, 4, 8) for compact in (True, False)],
)
def test_sent_plus_residual_is_g_plus_old_residual(grad_dtype: str, value_bits: int | None, compact: bool) -> None:
    """Through the exchange on one process (what arrives is what this rank sent): every step, every
    tensor, bit for bit, ``sent + e_new == g + e_old``; each sparse tensor sends the declared count
    and the telemetry counts it, with coded values (``value_bits``) and either index coding."""
    dtype = getattr(torch, grad_dtype)
    compressor = ChunkTopK(chunk=512)
    named = [(name, torch.zeros(n, dtype=dtype, requires_grad=True)) for name, n in SIZES.items()]
    params = [p for _, p in named]
    numel = sum(SIZES.values())
    state = SparseState(
        compressor=compressor, density=0.05, min_numel=100, value_bits=value_bits, compact_indices=compact,
        fallback_to_dense=False, seed=3,
    )  # fmt: skip
    state.bind(named)
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        g = (torch.randn(numel, generator=gen) * (1 + step)).to(dtype)
        plan = state.plan(g, params)
        old = {m.name: state.memory.get(m.name).clone() for m in plan.members if m.name in state.memory}
        out = communicate(state, g.clone(), params).wait().float()
        sparse_step = step >= state.config.warmup_steps
        for m in plan.members:
            seg = slice(m.offset, m.offset + m.numel)
            p = g[seg].float() + old[m.name] if m.name in old else g[seg].float()
            new = state.memory.get(m.name) if m.name in state.memory else torch.zeros(m.numel)
            assert torch.equal(out[seg] + new, p), f"step {step} {m.name}: sent + e_new != g + e_old"
            if m.sparse and sparse_step:
                assert int((out[seg] != 0).sum()) <= compressor.k_for(m.numel, 0.05)
                if value_bits is None:  # each row's top of p went out
                    picked = (out[seg] != 0).nonzero().squeeze(1)
                    counts = [int(((picked >= r.start) & (picked < r.stop)).sum()) for r in rows_of(m.numel, 512)]
                    assert counts == expected_counts(m.numel, 512, 0.05), m.name
        if sparse_step:
            sparse = [m for m in plan.members if m.sparse]
            small = sum(m.numel for m in plan.members if not m.sparse)
            assert state.telemetry.last.sent_numel == sum(compressor.k_for(m.numel, 0.05) for m in sparse) + small


@pytest.mark.parametrize("chunk", [4, 64, 512])
def test_a_bucket_at_once_picks_what_each_tensor_picks(chunk: int) -> None:
    """The wire's selection of a bucket's tensors in one ``torch.topk`` (``ChunkRows``) picks, tensor by tensor,
    what ``ChunkTopK.select`` picks: tensors of one row or less, of whole and partial rows, sent whole, and
    small tensors between them."""
    from lightning_sparse.wire.batched import ChunkRows
    from lightning_sparse.wire.context import BucketPlan, Member

    compressor = ChunkTopK(chunk=chunk)
    sizes = [3 * chunk + 1, chunk, chunk - 1, 7, 2 * chunk, 5 * chunk + chunk // 2, 1]
    sparse = [True, True, True, False, True, True, True]
    members, offset = [], 0
    for i, (n, s) in enumerate(zip(sizes, sparse, strict=True)):
        members.append(Member(f"t{i}", i, offset, n, s))
        offset += n
    plan = BucketPlan(tuple(members), offset, "bucket")
    gen = torch.Generator().manual_seed(chunk)
    for density in (0.01, 0.3, 1.0):
        ks = tuple(compressor.k_for(m.numel, density) for m in plan.sparse_members)
        e = torch.randn(offset, generator=gen)
        picks = ChunkRows.of(plan, ks, compressor, torch.device("cpu")).picks(e).sort().values
        expected = [
            compressor.select(e[m.offset : m.offset + m.numel], k, CTX) + m.offset
            for m, k in zip(plan.sparse_members, ks, strict=True)
        ]
        assert torch.equal(picks, torch.cat(expected).sort().values), density


def test_on_a_cpu_a_bucket_with_a_large_tensor_goes_one_tensor_at_a_time(monkeypatch: Any) -> None:
    """A CPU bucket holding a tensor of at least ``CPU_ONE_BY_ONE`` values is selected tensor by tensor (no rows
    laid out), the same picks as the bucket at once."""
    from lightning_sparse.wire import batched
    from lightning_sparse.wire.context import BucketCall, BucketPlan, Member, WireContext
    from lightning_sparse.wire.memory import ErrorFeedback
    from lightning_sparse.wire.stats import Counters

    compressor = ChunkTopK(chunk=4096)
    big = batched.CPU_ONE_BY_ONE + 5000
    plan = BucketPlan(
        (Member("w", 1, 0, big, True), Member("b", 2, big, 30, False), Member("v", 3, big + 30, 9000, True)),
        big + 9030,
        "w .. v",
    )
    ks = [compressor.k_for(m.numel, 0.01) for m in plan.sparse_members]
    buffer = torch.randn(plan.numel, generator=torch.Generator().manual_seed(4))
    calls: list[int] = []
    original = batched._one_by_one
    monkeypatch.setattr(batched, "_one_by_one", lambda *a: calls.append(1) or original(*a))
    ctx = WireContext(compressor, True, 0.0, None, 0, "allgather", True, None, True, memory=ErrorFeedback())
    selection = batched.batched_topk(
        ctx, BucketCall(buffer.clone(), plan, 0, Counters(), inputs_finite=True), ks, "chunk"
    )
    assert selection is not None and calls == [1]
    at_once = batched.ChunkRows.of(plan, tuple(ks), compressor, torch.device("cpu")).picks(buffer)
    assert torch.equal(selection.at.sort().values, at_once.sort().values)


# --------------------------------------------------------------------------- two processes
@pytest.mark.dist
def test_two_processes_conserve_and_agree(dist2) -> None:
    """On 2 gloo processes, the messages read off the wire (the update and gradient workers of the
    hook's tests): sent + new residual == progress + old residual exactly, each sparse tensor sends
    the declared count, the replicas' global parameters (update mode) and averaged gradients
    (gradient mode, bfloat16 values) are identical; and 2-bit values with compact indices
    (split exchange included) conserve and agree."""
    from test_hook_dist import _conservation_worker
    from test_update_dist import _update_worker
    from test_value_bits import _worker as coded_worker

    compressor = ChunkTopK(chunk=1000)  # the test's tensors of 2,000 to 360,000 values: 2 to 360 rows
    for r in dist2.run(_update_worker, compressor=compressor, value_dtype=None):
        assert r["sparse_steps"] == 3 and r["telemetry"]["sent_bytes"] < r["telemetry"]["dense_bytes"]
    results = dist2.run(
        _conservation_worker, compressor=compressor, value_dtype="bfloat16", grad_dtype="float32", error_feedback=True
    )
    assert results[0]["sparse_steps"] == 3
    for exchange in ("allgather", "split"):
        coded = dist2.run(coded_worker, bits=2, exchange=exchange, compressor=compressor)
        assert len({r["wire"] for r in coded}) == 1
        if exchange == "allgather":
            assert all(r["exact"] == 4 * 4 for r in coded)
