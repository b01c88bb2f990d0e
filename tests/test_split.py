"""The split exchange on fixed-size tensors: its padded message batches are byte for byte the
messages of the pairs they hold, each owner's choice is the reference's (largest sums, ties to the
smaller position), and a bucket's exchange reads nothing on the host besides the selection."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_sparse.exchange.step import bucket as exchange_bucket
from lightning_sparse.wire.indexcode import decode_counted_rows, encode_index_rows, encode_indices, rice_capacity_bytes
from lightning_sparse.wire.message import MessageLayout
from lightning_sparse.wire.split import _keep_largest_per_owner, _owner_choice


def _rows(gen: torch.Generator, n: int, cap: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` rows of ``cap`` indices into ``n``: a random count of sorted unique ones, then junk."""
    out, counts = [], []
    for _ in range(rows):
        c = int(torch.randint(0, cap + 1, (1,), generator=gen))
        idx = torch.randperm(n, generator=gen)[:c].sort().values
        out.append(torch.cat([idx, torch.randint(0, n, (cap - c,), generator=gen)]))
        counts.append(c)
    return torch.stack(out), torch.tensor(counts)


@pytest.mark.parametrize("seed", range(4))
def test_index_rows_code_as_each_row_alone(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        n = int(torch.randint(1, 4000, (1,), generator=gen))
        cap = int(torch.randint(1, min(n, 200) + 1, (1,), generator=gen))
        idx, counts = _rows(gen, n, cap, rows=3)
        out = torch.empty(3, rice_capacity_bytes(n, cap), dtype=torch.uint8)
        encode_index_rows(idx, counts, n, cap, out=out)
        decoded = decode_counted_rows(out, n, cap, counts, fill=n)
        for r, c in enumerate(counts.tolist()):
            assert torch.equal(out[r], encode_indices(idx[r, :c], n, cap))
            assert torch.equal(decoded[r, :c], idx[r, :c]) and bool((decoded[r, c:] == n).all())


CODINGS = [(None, torch.float32), (None, torch.bfloat16), (2, torch.float32), (4, torch.float32), (8, torch.float32)]


@pytest.mark.parametrize("bits,vdtype", CODINGS)
@pytest.mark.parametrize("compact", [True, False])
def test_message_rows_are_the_messages_of_their_pairs(bits: int | None, vdtype: torch.dtype, compact: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    for n, cap in [(1000, 37), (5000, 130), (300, 300), (64, 1)]:
        layout = MessageLayout(n, cap, vdtype, compact, header=True, value_bits=bits)
        coords, counts = _rows(gen, n, cap, rows=4)
        values = torch.randn(4, cap, generator=gen)
        values[0, 0] = float("nan")  # a non-finite value poisons its chunk alike
        messages, arriving = layout.pack_rows(coords, values.to(vdtype), counts)
        got_coords, got_values, got_counts = layout.unpack_counted_rows(messages)
        assert torch.equal(got_counts, counts)
        for r, c in enumerate(counts.tolist()):
            message, stands_for = layout.pack_arriving(coords[r, :c], values[r, :c].to(vdtype))
            assert torch.equal(messages[r], message), (n, cap, r)
            one_coords, one_values = layout.unpack(message)
            assert torch.equal(got_coords[r, :c], one_coords) and bool((got_coords[r, c:] == n).all())
            torch.testing.assert_close(got_values[r, :c], one_values, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(arriving[r, :c], stands_for, rtol=0, atol=0, equal_nan=True)
            assert bool((got_values[r, c:] == 0).all()) and bool((arriving[r, c:] == 0).all())


def _keep_largest_reference(owner: torch.Tensor, magnitude: torch.Tensor, world: int, cap: int) -> list[list[int]]:
    """Per owner, its positions (ascending), the ``cap`` largest magnitudes where more (ties: the
    smaller position): the exchange's choice before it worked on fixed-size tensors."""
    rows = []
    for j in range(world):
        mine = (owner == j).nonzero().squeeze(1).tolist()
        mine.sort(key=lambda i: (-float(magnitude[i]), i))
        rows.append(sorted(mine[:cap]))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_each_owner_gets_its_largest_picks_up_to_its_chunk(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    world, count = 4, 300
    skew = torch.tensor([0.7, 0.1, 0.1, 0.1])  # owner 0 draws more picks than its chunk holds
    owner = torch.multinomial(skew, count, replacement=True, generator=gen)
    magnitude = torch.randint(0, 20, (count,), generator=gen).float()  # many ties
    magnitude[5] = float("inf")
    for cap in (1, 60, 150, 300):
        table = _keep_largest_per_owner(owner, magnitude, world, cap)
        assert table.shape == (world, cap)
        for j, expected in enumerate(_keep_largest_reference(owner, magnitude, world, cap)):
            row = table[j].tolist()
            assert row == expected + [count] * (cap - len(expected))


@pytest.mark.parametrize("seed", range(6))
def test_an_owner_keeps_the_largest_sums_ties_to_the_smaller_position(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    world, cap, end = 3, 40, 200
    local, counts = _rows(gen, end, cap, rows=world)
    real = torch.arange(cap) < counts.unsqueeze(1)
    local = torch.where(real, local, end)
    values = torch.where(real, torch.randint(-3, 4, (world, cap), generator=gen).float(), 0.0)  # many ties
    sums: dict[int, float] = {}
    for r in range(world):  # the reference: every position's sum, in rank order
        for c in range(int(counts[r])):
            sums[int(local[r, c])] = sums.get(int(local[r, c]), 0.0) + float(values[r, c])
    for keep in (1, 10, 40, 120):
        chosen, chosen_sums = _owner_choice(local, values, end, keep)
        expected = sorted(sorted(sums, key=lambda p: (-abs(sums[p]), p))[:keep])
        assert chosen.tolist() == expected + [end] * (keep - len(expected))
        assert chosen_sums.tolist() == [sums[p] for p in expected] + [0.0] * (keep - len(expected))


def _count_reads(rank: int, world: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Host reads of one steady-state split exchange of one bucket, and those of its selection."""
    from benchmarks.opcount import OpCounter
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.wire import batched

    torch.manual_seed(0)
    named = [(f"w{i}", torch.randn(64, 48).requires_grad_(True)) for i in range(12)]
    named += [(f"b{i}", torch.randn(48).requires_grad_(True)) for i in range(12)]
    params = [p for _, p in named]
    options = {"compressor": "topk", "density": 0.02, "min_numel": 128, "seed": 3, "exchange": "split"}
    state = SparseState(**{**options, **settings})
    state.bind(named)
    selection = OpCounter()
    select = batched.batched_topk
    counting = False

    def counted_select(*args: Any) -> Any:
        if not counting:
            return select(*args)
        with selection:
            return select(*args)

    gen = torch.Generator().manual_seed(10 + rank)
    exchange = OpCounter()
    batched.batched_topk = counted_select  # type: ignore[assignment]
    try:
        for step in range(4):
            grad = torch.randn(sum(p.numel() for p in params), generator=gen)
            plan = state.plan(grad, params)
            counting = step == 3
            if counting:
                with exchange:
                    out = exchange_bucket(state, grad, plan, last=True).wait().as_dense()
            else:
                out = exchange_bucket(state, grad, plan, last=True).wait().as_dense()
    finally:
        batched.batched_topk = select  # type: ignore[assignment]
    return {
        "exchange": exchange.summary()["host_reads"],
        "selection": selection.summary()["host_reads"],
        "methods": list(state.telemetry.methods),
        "finite": bool(out.isfinite().all()),
    }


@pytest.mark.dist
@pytest.mark.parametrize("settings", [{}, {"value_bits": 2}, {"value_dtype": "bfloat16"}])
def test_the_split_reads_nothing_on_the_host_besides_the_selection(dist2: Any, settings: dict[str, Any]) -> None:
    for r in dist2.run(_count_reads, settings=settings):
        assert "topk (split)" in r["methods"] and r["finite"]
        # the batched selection's reads (whether every member's shortlist held k; the bucket's
        # finiteness, in gradient mode): none in the split's own work (there were 10 a bucket)
        assert r["exchange"] == r["selection"] <= 2, r
