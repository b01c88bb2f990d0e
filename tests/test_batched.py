"""The bucket-at-once selection and residuals (``lightning_sparse.wire.batched``, ``ErrorFeedback.flat``,
``bucket_parts``): the same coordinates, values, residuals and models as the one-tensor-at-a-time
path, to the bit, and conservation exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_sparse.compressors import TopK
from lightning_sparse.wire import batched
from lightning_sparse.wire import select as selection
from lightning_sparse.wire.context import BucketCall, BucketPlan, Member, WireContext
from lightning_sparse.wire.memory import ErrorFeedback
from lightning_sparse.wire.stats import Counters

#: (numel, sparse): matrices, vectors, small tensors sent dense between them, one large tensor
SIZES = [
    (64 * 97, True),
    (64, False),
    (64 * 192, True),
    (192, True),
    (64, False),
    (100_000, True),
    (300, True),
    (5, False),
]


def _plan(sizes: list[tuple[int, bool]] = SIZES) -> BucketPlan:
    members, offset = [], 0
    for i, (numel, sparse) in enumerate(sizes):
        members.append(Member(f"m{i}", 11 + i, offset, numel, sparse))
        offset += numel
    return BucketPlan(tuple(members), offset, "bucket")


def _select(plan: BucketPlan, inputs: list[torch.Tensor], at_once: bool, vdtype: torch.dtype, monkeypatch: Any) -> list:
    ks = [max(1, round(0.01 * m.numel)) for m in plan.sparse_members]
    ctx = WireContext(TopK(), True, 0.0, None, 0, "allgather", True, None, True, memory=ErrorFeedback())
    with monkeypatch.context() as patch:
        if not at_once:
            patch.setattr(batched, "eligible", lambda ctx, call: False)
        out = []
        for step, buffer in enumerate(inputs):
            before = {
                m.name: (ctx.memory.get(m.name) if m.name in ctx.memory else torch.zeros(m.numel)).clone()
                for m in plan.sparse_members
            }
            call = BucketCall(buffer.clone(), plan, step, Counters(), inputs_finite=True)
            sel = selection.select_sorted(ctx, call, ks, vdtype, settle=True)
            after = {m.name: ctx.memory.get(m.name).clone() for m in plan.sparse_members}
            out.append((sel.coords, sel.sent.float(), before, after, buffer))
    return out


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
def test_the_bucket_at_once_picks_what_one_tensor_at_a_time_picks(vdtype: torch.dtype, monkeypatch: Any) -> None:
    plan = _plan()
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(plan.numel, generator=gen) for _ in range(4)]
    at_once = _select(plan, inputs, True, vdtype, monkeypatch)
    one_by_one = _select(plan, inputs, False, vdtype, monkeypatch)
    space = selection.SparseSpace.of(plan)
    for (c1, v1, _, r1, _), (c2, v2, _, r2, _) in zip(at_once, one_by_one, strict=True):
        assert torch.equal(c1, c2)
        assert torch.equal(v1, v2)
        for name in r1:
            assert torch.equal(r1[name], r2[name]), name
    # conservation, exactly: sent + e_new == g + e_old at every coordinate of every sparse member
    for coords, sent, before, after, buffer in at_once:
        at = space.to_bucket(coords)
        for m in plan.sparse_members:
            p = buffer[m.offset : m.offset + m.numel] + before[m.name]
            total = after[m.name].clone()
            mine = (at >= m.offset) & (at < m.offset + m.numel)
            total[at[mine] - m.offset] += sent[mine]
            assert torch.equal(total, p), m.name


def test_ties_are_broken_either_way_among_equal_magnitudes(monkeypatch: Any) -> None:
    """Values on a coarse grid (bfloat16 parameters' updates): many magnitudes tie at the k-th. Both
    paths pick the k largest magnitudes; which of the tied coordinates may differ."""
    plan = _plan()
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randint(-8, 9, (plan.numel,), generator=gen).float() / 8 for _ in range(2)]
    at_once = _select(plan, inputs[:1], True, torch.float32, monkeypatch)[0]
    one_by_one = _select(plan, inputs[:1], False, torch.float32, monkeypatch)[0]
    assert torch.equal(at_once[1].abs().sort().values, one_by_one[1].abs().sort().values)
    coords, sent, before, after, buffer = at_once
    at = selection.SparseSpace.of(plan).to_bucket(coords)
    assert at.unique().numel() == at.numel()
    for m in plan.sparse_members:
        total = after[m.name].clone()
        mine = (at >= m.offset) & (at < m.offset + m.numel)
        total[at[mine] - m.offset] += sent[mine]
        assert torch.equal(total, buffer[m.offset : m.offset + m.numel] + before[m.name])


def test_a_member_with_fewer_nonzeros_than_k_takes_its_own_path(monkeypatch: Any) -> None:
    """Its threshold is 0 (zeros never pass it), its shortlist falls short of k: the host read says so
    and the members are selected one by one, with the same result."""
    plan = _plan([(20_000, True), (64, False), (5_000, True)])
    buffer = torch.randn(plan.numel, generator=torch.Generator().manual_seed(2))
    buffer[: 20_000 - 50] = 0.0  # 50 non-zeros where k is 200
    calls = []
    original = batched._one_by_one
    monkeypatch.setattr(batched, "_one_by_one", lambda *a: calls.append(1) or original(*a))
    at_once = _select(plan, [buffer], True, torch.float32, monkeypatch)
    one_by_one = _select(plan, [buffer], False, torch.float32, monkeypatch)
    assert calls == [1]
    assert torch.equal(at_once[0][0], one_by_one[0][0])
    assert torch.equal(at_once[0][3]["m0"], one_by_one[0][3]["m0"])


def test_a_non_finite_input_is_left_to_the_per_tensor_path(monkeypatch: Any) -> None:
    plan = _plan([(4_000, True), (2_000, True)])
    ctx = WireContext(TopK(), True, 0.0, None, 0, "allgather", True, None, True, memory=ErrorFeedback())
    buffer = torch.randn(plan.numel)
    buffer[10] = float("nan")
    call = BucketCall(buffer, plan, 0, Counters(), inputs_finite=False)
    assert batched.batched_topk(ctx, call, [40, 20]) is None
    assert len(ctx.memory) == 0  # nothing accumulated


def test_flat_residuals_are_the_residuals() -> None:
    ef = ErrorFeedback()
    ef.accumulate("w", torch.tensor([1.0, 2.0, 3.0]))
    layout = (("w", 3), (None, 2), ("v", 2))
    flat = ef.flat(layout, torch.device("cpu"))
    assert flat is not None and torch.equal(flat, torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]))
    flat[5:].add_(4.0)  # a write to the flat tensor is a write to the residual
    assert torch.equal(ef.get("v"), torch.tensor([4.0, 4.0]))
    assert ef.flat(layout, torch.device("cpu")) is flat  # kept
    assert ef.flush("w", torch.float32) is not None  # sent whole: it reads as zero from now on
    assert ef.flat(layout, torch.device("cpu")) is flat
    assert torch.equal(flat[:3], torch.zeros(3))
    ef.load_state_dict({"w": torch.ones(3), "v": torch.ones(2)})  # new tensors: the flat one is rebuilt
    again = ef.flat(layout, torch.device("cpu"))
    assert again is not flat and torch.equal(again, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]))
    state = ef.state_dict()
    assert torch.equal(state["w"], torch.ones(3)) and state["w"].numel() == 3
    ef.home = torch.device("cpu")  # offloaded residuals stay one tensor per name
    assert ef.flat(layout, torch.device("cpu")) is None


# ---------------------------------------------------------------------------- the update exchange, 2 ranks
def _update_worker(rank: int, world: int, at_once: bool, settings: dict[str, Any]) -> dict[str, Any]:
    from lightning_sparse.exchange import fragment

    saved = batched.eligible, fragment.Bucket.flat_params, selection._launch_coded_at_once
    if not at_once:  # the worker process outlives this test: put them back after it
        batched.eligible = lambda ctx, call: False  # type: ignore[assignment]
        fragment.Bucket.flat_params = lambda self: None  # type: ignore[assignment,method-assign]
        selection._launch_coded_at_once = lambda *args: None  # the small tensors' codes member by member
    try:
        return _update_run(rank, settings)
    finally:
        batched.eligible, fragment.Bucket.flat_params, selection._launch_coded_at_once = saved  # type: ignore[method-assign]


def _update_run(rank: int, settings: dict[str, Any]) -> dict[str, Any]:
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    torch.manual_seed(0)
    named = [
        ("emb", torch.randn(97, 64)),
        ("ln", torch.randn(64)),
        ("w1", torch.randn(256, 64)),
        ("b1", torch.randn(256)),
        ("w2", torch.randn(64, 256)),
        ("ln2", torch.randn(64)),
    ]
    named = [(n, p.requires_grad_(True)) for n, p in named]
    state = SparseState(compressor="topk", density=0.02, min_numel=128, seed=3, compress="update", **settings)
    exchange = UpdateExchange(state, bucket_bytes=1 << 16)
    exchange.bind(named)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        exchange.hold_local()
        with torch.no_grad():
            for _, p in named:
                p.add_((torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype))
        exchange.exchange()
    exchange.hold_global()
    return {
        "params": {n: p.detach().clone() for n, p in named},
        "residuals": state.memory.state_dict(),
    }


@pytest.mark.dist
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"sync_every": 2, "sync_delay": 1},
        {"value_dtype": "bfloat16"},
        {"value_bits": 2},
        {"exchange": "split", "value_bits": 2},
    ],
    ids=["default", "delay", "bf16 values", "2-bit", "split 2-bit"],
)
def test_the_update_exchange_at_once_equals_one_tensor_at_a_time(dist2: Any, settings: dict[str, Any]) -> None:
    flat = dist2.run(_update_worker, at_once=True, settings=dict(settings))
    per_tensor = dist2.run(_update_worker, at_once=False, settings=dict(settings))
    for a, b in zip(flat, per_tensor, strict=True):
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert a["residuals"].keys() == b["residuals"].keys()
        for name in a["residuals"]:
            assert torch.equal(a["residuals"][name], b["residuals"][name]), name
    for name in flat[0]["params"]:  # one global model
        assert torch.equal(flat[0]["params"][name], flat[1]["params"][name])
