"""Tests of the fixed-size Rice coding of sorted unique indices (lightning_sparse.wire.indexcode)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse.wire.indexcode import (
    INDEX_CODINGS,
    decode_index_rows,
    decode_indices,
    encode_indices,
    index_bytes,
    rice_capacity_bytes,
    rice_parameter,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def roundtrip(idx: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Encode and decode ``idx``; check the size and exactness, return the message."""
    data = encode_indices(idx, n, k)
    assert data.dtype == torch.uint8 and data.device == idx.device
    assert data.numel() == rice_capacity_bytes(n, k)
    back = decode_indices(data, n, k, idx.numel())
    assert back.dtype == torch.int64 and back.device == idx.device
    assert torch.equal(back, idx.long())
    return data


def random_set(n: int, c: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:c].sort().values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("density", [1e-4, 1e-3, 1e-2, 0.1, 0.5])
def test_roundtrip_uniform(density: float, device: str) -> None:
    n = 200_003
    k = math.ceil(density * n)
    for c, seed in ((k, 0), (k // 2, 1)):
        roundtrip(random_set(n, c, seed).to(device), n, k)


@pytest.mark.parametrize("device", DEVICES)
def test_roundtrip_clustered(device: str) -> None:
    n, k = 1_000_000, 1000
    sets = {
        "start": torch.arange(k),
        "middle": torch.arange(k) + 500_000,
        "end": torch.arange(n - k, n),  # one gap of n - k: the unary stream is used to the last bit
        "two clusters": torch.cat([torch.arange(5, 5 + k // 2), torch.arange(n - k // 2, n)]),
        "strided": torch.arange(k) * 997 + 3,
    }
    for name, idx in sets.items():
        data = roundtrip(idx.to(device), n, k)
        assert data.numel() == rice_capacity_bytes(n, k), name


def test_end_cluster_fills_unary_stream() -> None:
    # the bound is tight: all k indices at the very end use every bit of the unary stream
    n, k = 100_000, 100
    b = rice_parameter(n, k)
    unary_bits = k + (n - k) // 2**b
    data = encode_indices(torch.arange(n - k, n), n, k)
    low_bytes = math.ceil(k * b / 8)
    assert data.numel() == low_bytes + math.ceil(unary_bits / 8)
    bits = ((data[low_bytes:].unsqueeze(1) >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1).flatten()
    assert int(bits[:unary_bits].sum()) == k and bits[unary_bits - 1] == 1 and not bits[unary_bits:].any()


@pytest.mark.parametrize(
    ("idx", "n", "k"),
    [
        ([], 10, 0),  # no capacity at all
        ([], 10, 4),  # nothing sent
        ([], 1, 1),
        ([0], 1, 1),  # n = 1
        (list(range(50)), 50, 50),  # every index
        ([49], 50, 1),  # the single last index
        ([49], 50, 10),  # ... with c < k
        ([0, 49], 50, 7),
        ([2, 3], 5, 9),  # k > n
        (list(range(5)), 5, 9),
        ([(1 << 40) - 1], 1 << 40, 3),  # huge n, one far index
    ],
)
def test_roundtrip_extremes(idx: list[int], n: int, k: int) -> None:
    data = roundtrip(torch.tensor(idx, dtype=torch.int64), n, k)
    if k == 0:
        assert data.numel() == 0
    if not idx:
        assert not data.any()  # unused bits are zero


def test_int32_input() -> None:
    idx = random_set(10_000, 300)
    assert torch.equal(encode_indices(idx.int(), 10_000, 300), encode_indices(idx, 10_000, 300))


@pytest.mark.parametrize("fill", [0, 0xAB])
def test_out_slice_of_bigger_message(fill: int) -> None:
    n, k = 100_000, 1000
    idx = random_set(n, 700)
    size = rice_capacity_bytes(n, k)
    buf = torch.full((size + 37 + 11,), fill, dtype=torch.uint8)
    before = buf.clone()
    got = encode_indices(idx, n, k, out=buf[37 : 37 + size])
    assert got.data_ptr() == buf[37:].data_ptr() and got.numel() == size
    assert torch.equal(buf[37 : 37 + size], encode_indices(idx, n, k))
    assert torch.equal(buf[:37], before[:37]) and torch.equal(buf[37 + size :], before[37 + size :])
    assert torch.equal(decode_indices(buf[37 : 37 + size], n, k, 700), idx)


@st.composite
def index_sets(draw: st.DrawFn) -> tuple[torch.Tensor, int, int]:
    """Sorted unique sets with adversarial gaps: runs of tiny gaps mixed with huge ones."""
    gaps = draw(
        st.lists(
            st.one_of(st.integers(0, 3), st.integers(0, 1 << 22), st.sampled_from([63, 64, 127, 128])), max_size=60
        )
    )
    idx = torch.cumsum(torch.tensor(gaps, dtype=torch.int64) + 1, 0) - 1
    n = (int(idx[-1]) + 1 if gaps else 1) + draw(st.integers(0, 1000))
    k = len(gaps) + draw(st.sampled_from([0, 0, 1, 5, 200]))
    return idx, n, k


@settings(max_examples=150, deadline=None)
@given(index_sets())
def test_roundtrip_property(case: tuple[torch.Tensor, int, int]) -> None:
    idx, n, k = case
    roundtrip(idx, n, k)


def test_size_per_index_at_one_percent() -> None:
    n, k = 1_000_000, 10_000
    assert rice_parameter(n, k) == 6
    assert rice_capacity_bytes(n, k) / k <= 1.1
    assert index_bytes(n, k, "rice") / index_bytes(n, k, "int32") < 0.28


def test_rice_parameter_minimizes_bound() -> None:
    for n in (1, 2, 7, 100, 1000, 12_345, 10**6, 25 * 10**6, 10**9):
        for k in {1, 2, 3, n // 1000, n // 100, n // 10, n // 3, n - 1, n, n + 5, 7 * n}:
            if k < 1:
                continue
            cost = [k * (b + 1) + max(n - k, 0) // 2**b for b in range(41)]
            assert rice_parameter(n, k) == cost.index(min(cost)), (n, k)
    assert rice_parameter(100, 0) == 0 and rice_capacity_bytes(100, 0) == 0


def test_index_bytes() -> None:
    assert INDEX_CODINGS == ("int32", "rice")
    assert index_bytes(1000, 17, "int32") == 68
    assert index_bytes(1000, 17, "rice") == rice_capacity_bytes(1000, 17)
    with pytest.raises(ValueError, match="coding"):
        index_bytes(1000, 17, "int16")


def test_bad_arguments() -> None:
    idx = torch.tensor([1, 5, 9])
    with pytest.raises(ValueError, match="idx"):
        encode_indices(idx, 100, 2)  # c > k
    with pytest.raises(ValueError, match="idx"):
        encode_indices(torch.tensor([0, 1, 2]), 2, 5)  # c > n
    with pytest.raises(ValueError, match="n="):
        encode_indices(idx, 0, 5)
    with pytest.raises(ValueError, match="k="):
        encode_indices(idx, 100, -1)
    with pytest.raises(ValueError, match="idx"):
        encode_indices(idx.view(1, 3), 100, 5)
    with pytest.raises(ValueError, match="idx"):
        encode_indices(idx.float(), 100, 5)
    with pytest.raises(ValueError, match="idx"):
        encode_indices([1, 5, 9], 100, 5)  # type: ignore[arg-type]
    size = rice_capacity_bytes(100, 5)
    with pytest.raises(ValueError, match="out"):
        encode_indices(idx, 100, 5, out=torch.zeros(size + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out"):
        encode_indices(idx, 100, 5, out=torch.zeros(size, dtype=torch.int8))
    data = encode_indices(idx, 100, 5)
    with pytest.raises(ValueError, match="data"):
        decode_indices(data[:-1], 100, 5, 3)
    with pytest.raises(ValueError, match="data"):
        decode_indices(data.to(torch.int32), 100, 5, 3)
    with pytest.raises(ValueError, match="count"):
        decode_indices(data, 100, 5, 6)  # count > k
    # more than the message holds: what it holds is data, checked on the device (an asynchronous
    # assertion: no host read), which raises a RuntimeError on CPU tensors
    with pytest.raises(RuntimeError, match="count"):
        decode_indices(data, 100, 5, 4)
    with pytest.raises(ValueError, match="k="):
        rice_capacity_bytes(100, -3)
    with pytest.raises(ValueError, match="n="):
        rice_parameter(0, 3)


@pytest.mark.parametrize("bad", [[3, 2, 7], [2, 2, 7], [-1, 2, 7], [2, 7, 100], [2, 7, 1000]])
def test_validate(bad: list[int]) -> None:
    idx = torch.tensor(bad)
    with pytest.raises(ValueError, match="idx.*strictly increasing"):
        encode_indices(idx, 100, 5, validate=True)
    encode_indices(idx, 100, 5)  # unchecked: no error and no write outside the message
    roundtrip(torch.tensor([2, 7, 99]), 100, 5)
    encode_indices(torch.tensor([2, 7, 99]), 100, 5, validate=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("n", "k", "rows"), [(1000, 3, 1), (100_000, 1000, 2), (50, 50, 3), (7, 1, 8), (10**6, 5000, 4)]
)
def test_rows_decode_as_each_row_alone(device: str, n: int, k: int, rows: int) -> None:
    """Every rank's message of an all-gather decoded at once equals each decoded by itself."""
    sets = [random_set(n, k, seed=r).to(device) for r in range(rows)]
    data = torch.stack([encode_indices(idx, n, k) for idx in sets])
    got = decode_index_rows(data, n, k, k)
    assert got.shape == (rows, k) and got.dtype == torch.int64
    for r in range(rows):
        assert torch.equal(got[r], decode_indices(data[r], n, k, k))
        assert torch.equal(got[r], sets[r])


def test_rows_decode_refuses_a_short_row() -> None:
    """A row that holds fewer indices than asked for fails the device-side check, wherever it is."""
    full, short = encode_indices(torch.tensor([1, 2, 3]), 1000, 3), encode_indices(torch.tensor([1, 2]), 1000, 3)
    for data in (torch.stack([short, full]), torch.stack([full, short])):
        with pytest.raises(RuntimeError, match="count"):
            decode_index_rows(data, 1000, 3, 3)
    with pytest.raises(ValueError, match="data"):
        decode_index_rows(full, 1000, 3, 3)  # one message: decode_indices
