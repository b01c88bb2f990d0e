"""Fixed-size, exactly decodable coding of sorted unique coordinate indices (Rice code on gaps).

A message of ``c <= k`` strictly increasing indices into ``[0, n)`` must have a size known from
``(n, k)`` alone (collectives need equal sizes on every rank). Its gaps ``v_0 = idx_0``,
``v_i = idx_i - idx_{i-1} - 1`` are coded with a Rice parameter ``b = rice_parameter(n, k)``:
``[low stream: the low b bits of every gap, ceil(k*b/8) bytes][unary stream: v_i >> b zero bits and a
one bit per gap, ceil((k + max(n-k, 0) // 2**b)/8) bytes]``, unused bits zero.

The bound holds for any indices: the gaps sum to at most ``n - c``, so the unary stream holds at most
``c + (n - c) // 2**b`` bits, nondecreasing in ``c`` and so at most ``k + (n - k) // 2**b``. ``b``
minimizes the worst case ``k*(b+1) + (n-k) // 2**b``: about ``log2(n/k) + 2`` bits an index.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lightning_sparse._utils import bad_argument, check_int

__all__ = [
    "INDEX_CODINGS",
    "decode_counted_rows",
    "decode_index_rows",
    "decode_indices",
    "encode_index_rows",
    "encode_indices",
    "index_bytes",
    "rice_capacity_bytes",
    "rice_parameter",
]

INDEX_CODINGS = ("int32", "rice")


def rice_parameter(n: int, k: int) -> int:
    """The ``b >= 0`` minimizing the worst-case size ``k*(b+1) + max(n-k, 0) // 2**b`` in bits
    (ties: the smaller ``b``); 0 when ``k == 0``.

    >>> rice_parameter(1_000_000, 10_000)
    6
    """
    _check_sizes(n, k)
    if k == 0:
        return 0
    m = max(n - k, 0)
    # for b >= m.bit_length() the second term is 0 and the first only grows
    return min(range(m.bit_length() + 1), key=lambda b: (k * (b + 1) + (m >> b), b))


@functools.lru_cache(maxsize=4096)  # sizes only: asked for every message at every step
def _stream_bytes(n: int, k: int) -> tuple[int, int, int]:
    """``(b, low stream bytes, unary stream bytes)`` for ``(n, k)``."""
    b = rice_parameter(n, k)
    if k == 0:
        return 0, 0, 0
    return b, -(-k * b // 8), -(-(k + (max(n - k, 0) >> b)) // 8)


def rice_capacity_bytes(n: int, k: int) -> int:
    """Bytes of a Rice-coded message with room for any ``c <= k`` sorted unique indices in ``[0, n)``.

    >>> rice_capacity_bytes(1_000_000, 10_000)
    10684
    """
    _, low, unary = _stream_bytes(n, k)
    return low + unary


def index_bytes(n: int, k: int, coding: str) -> int:
    """Bytes the index part of a message of ``k`` indices into ``n`` elements takes with ``coding``.

    >>> index_bytes(1_000_000, 10_000, "int32"), index_bytes(1_000_000, 10_000, "rice")
    (40000, 10684)
    """
    if coding not in INDEX_CODINGS:
        raise bad_argument("coding", coding, f"expected one of {INDEX_CODINGS}")
    _check_sizes(n, k)
    return 4 * k if coding == "int32" else rice_capacity_bytes(n, k)


@functools.lru_cache(maxsize=4096, typed=True)  # sizes only, checked at every message: a hit runs no Python
def _check_sizes(n: int, k: int, count: int | None = None) -> None:
    check_int("n", n, minimum=1)
    check_int("k", k, minimum=0)
    if count is not None:
        check_int("count", count, minimum=0, maximum=min(k, n))


def _pack(bits: Tensor) -> Tensor:
    """Pack a uint8 0/1 tensor whose length is a multiple of 8 into bytes, MSB first."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=bits.device)  # made there: no host copy
    return (bits.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


def _unpack(data: Tensor) -> Tensor:
    """Bits (uint8 0/1, MSB first) of a uint8 tensor: flat for a 1-D tensor, one row of bits per row
    of a 2-D one."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=data.device)
    bits = (data.unsqueeze(-1) >> shifts) & 1
    return bits.flatten() if data.dim() == 1 else bits.reshape(data.shape[0], -1)


def encode_indices(idx: Tensor, n: int, k: int, out: Tensor | None = None, *, validate: bool = False) -> Tensor:
    """Rice-code strictly increasing indices ``idx`` (int64/int32, values in ``[0, n)``, at most
    ``k`` of them) into a uint8 tensor of exactly ``rice_capacity_bytes(n, k)`` bytes.

    ``out``, if given (1-D uint8 of that size on ``idx``'s device), is overwritten and returned. Order and
    range are checked only with ``validate=True`` (a host read); bad input never writes outside ``out``.

    >>> data = encode_indices(torch.tensor([3, 4, 900, 901, 999]), n=1000, k=8)
    >>> data.numel() == rice_capacity_bytes(1000, 8)
    True
    """
    _check_sizes(n, k)
    if not isinstance(idx, Tensor) or idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32):
        raise bad_argument("idx", idx, "expected a 1-D int64 or int32 tensor")
    c = idx.numel()
    if c > min(k, n):
        raise bad_argument("idx", idx, f"expected at most min(k, n)={min(k, n)} indices")
    b, low_bytes, unary_bytes = _stream_bytes(n, k)
    dev = idx.device
    if out is None:
        out = torch.empty(low_bytes + unary_bytes, dtype=torch.uint8, device=dev)
    elif not isinstance(out, Tensor) or out.dtype != torch.uint8 or out.dim() != 1 or out.device != dev:
        raise bad_argument("out", out, f"expected a 1-D uint8 tensor on {dev}")
    elif out.numel() != low_bytes + unary_bytes:
        raise bad_argument("out", out, f"expected rice_capacity_bytes(n, k)={low_bytes + unary_bytes}")
    idx = idx.long()
    if validate and c and not (bool(idx[0] >= 0) and bool(idx[-1] < n) and bool((idx[1:] > idx[:-1]).all())):
        raise bad_argument("idx", idx, f"expected strictly increasing values in [0, {n}) (validate=True)")
    v = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1
    low = torch.zeros(low_bytes * 8, dtype=torch.uint8, device=dev)
    if b:
        shifts = torch.arange(b - 1, -1, -1, device=dev)
        low[: c * b] = ((v.unsqueeze(1) >> shifts) & 1).flatten()
    unary = torch.zeros(unary_bytes * 8, dtype=torch.uint8, device=dev)
    if c:
        # position of each terminating one bit; clamped so that unchecked bad input stays in bounds
        ones = torch.cumsum((v >> b) + 1, 0).sub_(1).clamp_(0, unary.numel() - 1)
        unary.index_fill_(0, ones, 1)  # a fill, not an assignment from a host tensor
    out[:low_bytes] = _pack(low)
    out[low_bytes:] = _pack(unary)
    return out


def decode_indices(data: Tensor, n: int, k: int, count: int) -> Tensor:
    """Decode the first ``count`` indices of a message written by ``encode_indices(idx, n, k)``
    (``count == idx.numel()``); returns them as an int64 tensor on ``data``'s device.

    >>> data = encode_indices(torch.tensor([3, 4, 900, 901, 999]), n=1000, k=8)
    >>> decode_indices(data, n=1000, k=8, count=5).tolist()
    [3, 4, 900, 901, 999]
    """
    _check_sizes(n, k, count)
    size = rice_capacity_bytes(n, k)
    if not isinstance(data, Tensor) or data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != size:
        raise bad_argument("data", data, f"expected a 1-D uint8 tensor of rice_capacity_bytes(n, k)={size} bytes")
    # no host read: a message with fewer than ``count`` indices fails a device-side assertion
    return decode_index_rows(data.unsqueeze(0), n, k, count)[0]


def decode_index_rows(data: Tensor, n: int, k: int, count: int) -> Tensor:
    """:func:`decode_indices` of every row of ``data`` (one message per row, as an all-gather
    leaves them) in the same operators whatever the number of rows: ``(rows, count)`` int64.

    >>> rows = torch.stack([encode_indices(torch.tensor([3, 4, 900]), n=1000, k=3),
    ...                     encode_indices(torch.tensor([0, 7, 999]), n=1000, k=3)])
    >>> decode_index_rows(rows, n=1000, k=3, count=3).tolist()
    [[3, 4, 900], [0, 7, 999]]
    """
    _check_sizes(n, k, count)
    b, low_bytes, unary_bytes = _stream_bytes(n, k)
    size = low_bytes + unary_bytes
    if not isinstance(data, Tensor) or data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != size:
        raise bad_argument("data", data, f"expected a 2-D uint8 tensor of rice_capacity_bytes(n, k)={size} bytes a row")
    rows = data.shape[0]
    # every row's terminating one bits; a row holding fewer than ``count`` fails the assertion
    if not rows or not count:
        return torch.zeros(rows, count, dtype=torch.int64, device=data.device)
    ones = torch.nonzero_static(_unpack(data[:, low_bytes:]), size=rows * count, fill_value=-1)
    owner = torch.arange(rows, device=data.device).unsqueeze(1).expand(rows, count).reshape(-1)
    torch._assert_async((ones[:, 0] == owner).all(), f"count={count} is not allowed: a message holds fewer indices")
    at = ones[:, 1].view(rows, count)
    v = (torch.diff(at, dim=1, prepend=at.new_full((rows, 1), -1)) - 1) << b
    if b:
        shifts = torch.arange(b - 1, -1, -1, device=data.device)
        v |= (_unpack(data[:, :low_bytes])[:, : count * b].view(rows, count, b).long() << shifts).sum(2)
    # one flat scan, not one along each row (a thread per row on a GPU): exact in int64
    return _running_in_rows(v + 1)


def encode_index_rows(idx: Tensor, counts: Tensor, n: int, k: int, out: Tensor) -> Tensor:
    """:func:`encode_indices` of every row of ``idx`` (``(rows, k)``; row ``r`` holds its ``counts[r]``
    indices first, then anything) into ``out`` (``(rows, rice_capacity_bytes(n, k))`` uint8), byte for
    byte; the counts stay on the device (no host read).

    >>> rows = torch.tensor([[3, 4, 900], [0, 7, 0]])
    >>> out = torch.empty(2, rice_capacity_bytes(1000, 3), dtype=torch.uint8)
    >>> _ = encode_index_rows(rows, torch.tensor([3, 2]), n=1000, k=3, out=out)
    >>> torch.equal(out[1], encode_indices(torch.tensor([0, 7]), n=1000, k=3))
    True
    """
    _check_sizes(n, k)
    b, low_bytes, unary_bytes = _stream_bytes(n, k)
    rows, width = idx.shape
    dev = idx.device
    valid = torch.arange(width, device=dev) < counts.unsqueeze(1)
    idx = idx.long()
    v = torch.diff(idx, dim=1, prepend=idx.new_full((rows, 1), -1)).sub_(1).mul_(valid)  # 0 past the count
    if b:
        shifts = torch.arange(b - 1, -1, -1, device=dev)
        low = torch.zeros(rows, low_bytes * 8, dtype=torch.uint8, device=dev)
        low[:, : width * b] = ((v.unsqueeze(2) >> shifts) & 1).view(rows, width * b)
        out[:, :low_bytes] = _pack(low).view(rows, low_bytes)
    # each terminating one bit (past the count: a spare last column); clamped so bad input stays in bounds
    bits = unary_bytes * 8
    ones = _running_in_rows(((v >> b) + 1).mul_(valid)).clamp_(0, max(bits - 1, 0))
    ones.add_(torch.arange(0, rows * bits, bits, device=dev).unsqueeze(1))
    unary = torch.zeros(rows * bits + 1, dtype=torch.uint8, device=dev)
    unary.index_fill_(0, torch.where(valid, ones, rows * bits).view(-1), 1)
    out[:, low_bytes:] = _pack(unary[:-1]).view(rows, unary_bytes)
    return out


def decode_counted_rows(data: Tensor, n: int, k: int, counts: Tensor, fill: int) -> Tensor:
    """The indices :func:`encode_index_rows` wrote into each row of ``data``, row ``r`` holding
    ``counts[r]`` of them (a tensor: no host read): ``(rows, k)`` int64, ``fill`` past each row's
    count.

    >>> rows = torch.stack([encode_indices(torch.tensor([3, 4, 900]), n=1000, k=3),
    ...                     encode_indices(torch.tensor([0, 7]), n=1000, k=3)])
    >>> decode_counted_rows(rows, n=1000, k=3, counts=torch.tensor([3, 2]), fill=1000).tolist()
    [[3, 4, 900], [0, 7, 1000]]
    """
    _check_sizes(n, k)
    b, low_bytes, unary_bytes = _stream_bytes(n, k)
    rows = data.shape[0]
    dev = data.device
    if not rows or not k:
        return torch.full((rows, k), fill, dtype=torch.int64, device=dev)
    counts = counts.long()
    valid = torch.arange(k, device=dev) < counts.unsqueeze(1)
    # the i-th one bit belongs to the row whose counts' running sum first exceeds i (a row holding
    # another count fails the assertion)
    ones = torch.nonzero_static(_unpack(data[:, low_bytes:]), size=rows * k, fill_value=-1)
    ends = torch.cumsum(counts, 0)
    i = torch.arange(rows * k, device=dev)
    row = torch.searchsorted(ends, i, right=True)
    torch._assert_async((ones[:, 0] == torch.where(row < rows, row, -1)).all(), "a message holds another count")
    slot = (row * k + i).sub_(ends.sub(counts)[row.clamp(max=rows - 1)]).clamp_(max=rows * k)
    at = torch.zeros(rows * k + 1, dtype=torch.int64, device=dev).scatter_(0, slot, ones[:, 1])[:-1].view(rows, k)
    v = torch.diff(at, dim=1, prepend=at.new_full((rows, 1), -1)).sub_(1).mul_(valid) << b
    if b:
        shifts = torch.arange(b - 1, -1, -1, device=dev)
        v |= (_unpack(data[:, :low_bytes])[:, : k * b].view(rows, k, b).long() << shifts).sum(2)
    return torch.where(valid, _running_in_rows((v + 1).mul_(valid)), fill)


def _running_in_rows(steps: Tensor) -> Tensor:
    """Per row of ``steps`` (``(rows, width)``), its running sum less one, from one flat scan."""
    rows, width = steps.shape
    flat = torch.cumsum(steps.reshape(-1), 0).view(rows, width)
    before = torch.cat([flat.new_zeros(1), flat[:-1, -1]])
    return flat.sub_(before.unsqueeze(1)).sub_(1)
