"""Low-bit values (``value_bits``): the codes, the messages, and conservation on 2 and 4 real gloo
processes with both exchanges: what each rank takes out of ``p = g + e`` is exactly what the codes
it sent stand for, and what every rank applies is the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import DistPool
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse import SparseConfig, SparseDDPStrategy
from lightning_sparse.wire import MessageLayout
from lightning_sparse.wire.quant import CHUNK, code_bytes, dequantize, levels, pack_codes, quantize, unpack_codes

SHAPES = {"a.weight": (60, 70), "a.bias": (60,), "b.weight": (5000,), "c.weight": (64, 80)}


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    n=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
    spread=st.floats(0.0, 30.0),
)
def test_codes_round_trip_and_leave_an_exact_remainder(bits: int, n: int, seed: int, spread: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * spread / 3)
    codes, scales = quantize(v, bits)
    assert int(codes.abs().max()) <= levels(bits) and scales.numel() == (n + CHUNK - 1) // CHUNK
    packed = torch.empty(code_bytes(n, bits), dtype=torch.uint8)
    pack_codes(codes, bits, packed)
    assert torch.equal(unpack_codes(packed, n, bits), codes)
    d = dequantize(codes, scales, bits)
    remainder = v - d
    assert torch.equal(d + remainder, v)  # what stays in the residual is exact
    if bits == 8:
        assert float((remainder.abs() - d.abs().max() / 127).max()) <= float(scales.float().max()) * 2**-7


def test_message_with_codes_is_smaller_and_decodes() -> None:
    coords = torch.arange(0, 100_000, 100)
    values = torch.randn(1000)
    plain = MessageLayout(100_000, 1000, torch.float32, compact=True)
    for bits in (2, 4, 8):
        layout = MessageLayout(100_000, 1000, torch.float32, compact=True, value_bits=bits)
        assert layout.size < plain.size
        assert layout.size >= 1000 * bits // 8 + 2 * (1000 // CHUNK)
        got, decoded = layout.unpack(layout.pack(coords, values))
        assert torch.equal(got, coords)
        assert torch.equal(decoded, dequantize(*quantize(values, bits), bits))


@pytest.mark.parametrize("bits", [None, 2, 4, 8])
@pytest.mark.parametrize("compact", [True, False])
def test_messages_decode_at_once_as_one_by_one(bits: int | None, compact: bool) -> None:
    """An all-gather's messages decoded as rows equal each decoded alone, and what ``pack_arriving``
    says arrives is what the message decodes to (the sender needs no decode of its own message)."""
    layout = MessageLayout(100_000, 1000, torch.float32, compact=compact, value_bits=bits)
    gen = torch.Generator().manual_seed(bits or 0)
    messages, arriving = [], []
    for _ in range(3):
        coords = torch.randperm(100_000, generator=gen)[:1000].sort().values
        message, values = layout.pack_arriving(coords, torch.randn(1000, generator=gen))
        messages.append(message)
        arriving.append(values)
    coords_rows, values_rows = layout.unpack_rows(torch.stack(messages))
    for r, message in enumerate(messages):
        coords, values = layout.unpack(message)
        assert torch.equal(coords_rows[r], coords)
        assert torch.equal(values_rows[r], values)
        assert torch.equal(arriving[r], values)


def test_a_nonfinite_value_poisons_its_chunk_only() -> None:
    v = torch.randn(3 * CHUNK)
    v[CHUNK + 5] = float("nan")
    d = dequantize(*quantize(v, 4), 4)
    assert bool(torch.isfinite(d[:CHUNK]).all()) and bool(torch.isfinite(d[2 * CHUNK :]).all())
    assert not bool(torch.isfinite(d[CHUNK : 2 * CHUNK]).any())


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"value_bits": 3}, r"value_bits=3 is not allowed: expected None, 2, 4 or 8"),
        ({"value_bits": 2, "compressor": "randomk"}, r"value_bits=2 is not allowed with compressor=RandomK"),
        ({"value_bits": 8, "value_dtype": "bfloat16"}, r"value_bits=8 is not allowed with value_dtype='bfloat16'"),
    ],
)
def test_bad_value_bits_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SparseDDPStrategy(**settings)


def _worker(rank: int, world: int, bits: int, exchange: str, compressor: Any = "topk") -> dict[str, Any]:
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    named = [(n, torch.zeros(s, requires_grad=True)) for n, s in SHAPES.items()]
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    config = SparseConfig(
        compress="gradient", compressor=compressor, density=0.03, min_numel=1000, seed=3, fallback_to_dense=False,
        exchange=exchange, value_bits=bits,
    )  # fmt: skip
    state = SparseState(config)
    state.bind(named)
    plan = state.plan(torch.zeros(numel), params)
    exact_steps = 0
    for step in range(5):
        g = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))
        g[3048:3175] *= 20.0
        old = {m.name: state.memory.get(m.name).clone() for m in plan.members if m.name in state.memory}
        out = communicate(state, g.clone(), params).wait().clone()
        taken = torch.zeros(numel)
        for m in plan.members:  # the small tensor (a.bias) travels coded too, after the warm-up
            seg = slice(m.offset, m.offset + m.numel)
            p = g[seg] + old[m.name] if m.name in old else g[seg]
            e = state.memory.get(m.name) if m.name in state.memory else torch.zeros(m.numel)
            taken[seg] = p - e
            if exchange == "allgather" or not m.sparse:  # (the split adds an owner's coding error on top)
                assert torch.equal(taken[seg] + e, p), "sent + e_new == p, bit for bit"
            if step > 0 and not m.sparse:
                assert e.abs().sum() > 0, "2-8-bit codes leave a rounding error in the small tensor's residual"
        everyone = [torch.empty_like(taken) for _ in range(world)]
        dist.all_gather(everyone, taken)
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out)
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), "ranks differ"
        if step == 0:
            continue  # dense warm-up
        in_order = torch.zeros(numel)
        for part in everyone:
            in_order += part
        for m in plan.members:
            seg = slice(m.offset, m.offset + m.numel)
            if exchange == "allgather" or not m.sparse:  # every rank's coded values, added in rank order
                assert torch.equal(out[seg] * world, in_order[seg]), f"step {step} {m.name}: not conserved"
                exact_steps += 1
            else:  # an owner keeps its sum's coding error: conserved to float32 rounding of that add
                torch.testing.assert_close(out[seg].double() * world, in_order[seg].double(), rtol=0, atol=1e-5)
    return {"wire": state.telemetry.total.wire_bytes, "exact": exact_steps}


@pytest.fixture(scope="module")
def dist4():
    pool = DistPool(world_size=4)
    yield pool
    pool.stop()


@pytest.mark.dist
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("exchange", ["allgather", "split"])
@pytest.mark.parametrize("world", [2, 4])
def test_coded_values_conserve_and_agree(dist2, dist4, world: int, exchange: str, bits: int) -> None:
    pool = dist2 if world == 2 else dist4
    results = pool.run(_worker, bits=bits, exchange=exchange)
    assert len({r["wire"] for r in results}) == 1
    if exchange == "allgather":
        assert all(r["exact"] == 4 * 4 for r in results)


def _bytes_worker(rank: int, world: int, bits: int | None) -> float:
    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    named = [(n, torch.zeros(s, requires_grad=True)) for n, s in SHAPES.items()]
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    state = SparseState(density=0.03, min_numel=1000, fallback_to_dense=False, value_bits=bits)
    state.bind(named)
    for step in range(3):
        communicate(state, torch.randn(numel, generator=torch.Generator().manual_seed(step)), params).wait()
    return state.telemetry.last.sent_bytes


@pytest.mark.dist
def test_telemetry_counts_the_packed_bytes(dist2) -> None:
    plain = dist2.run(_bytes_worker, bits=None)[0]
    coded = {bits: dist2.run(_bytes_worker, bits=bits)[0] for bits in (2, 4, 8)}
    assert coded[2] < coded[4] < coded[8] < plain


@pytest.mark.parametrize(("bits", "most"), [(2, 28), (4, 15), (8, 7)])
def test_small_tensors_go_coded_only_where_that_moves_fewer_bytes(bits: int, most: int) -> None:
    """All-gathered codes grow with the ranks, a float all-reduce does not: past ``most`` ranks the
    small tensors of a sparse send go back to the all-reduce (the GPT task's 9,728 small values)."""
    from lightning_sparse.wire.quant import coded_members_pay

    assert coded_members_pay(2, 9728, bits) and coded_members_pay(most, 9728, bits)
    assert not coded_members_pay(most + 1, 9728, bits) and not coded_members_pay(64, 9728, bits)
