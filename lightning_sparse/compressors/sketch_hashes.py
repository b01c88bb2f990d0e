"""Count-sketch hashes (a shift and a sign per row and block of a table) and the median estimates read through them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_sparse._utils import scratch

_SEGMENT = 1 << 17  # coordinates per segment of short blocks handled at once
#: coordinates that may be heavy: (first coordinate of a block or segment, their offsets, each row's values there)
Heavy = tuple[int, Tensor, list[Tensor]]


@dataclass(frozen=True)
class SketchHashes:
    """The hash parameters of one table: per (row, block) shift and sign, on the host and device.

    Example:
        >>> from lightning_sparse.compressors import CompressContext, CountSketch
        >>> h = CountSketch(rows=3).hashes(CompressContext(step=1), numel=1000, cols=100, device=torch.device("cpu"))
        >>> h.shifts_t.shape, h.blocks
        (torch.Size([3, 10]), 10)
    """

    cols: int
    numel: int
    shifts: list[list[int]]
    signs: list[list[float]]
    shifts_t: Tensor  # (rows, blocks) int64, on the tensor's device
    signs_t: Tensor  # (rows, blocks) float32, on the tensor's device
    generator: torch.Generator  # the shared generator, advanced past the hash parameters

    @property
    def blocks(self) -> int:
        return len(self.shifts[0])


def segments(h: SketchHashes) -> list[tuple[int, int, int, int]]:
    """``(first block, end block, first coordinate, length)`` of runs of about ``_SEGMENT`` coordinates."""
    per = max(1, _SEGMENT // h.cols)
    bounds = [(b0, min(h.blocks, b0 + per)) for b0 in range(0, h.blocks, per)]
    return [(b0, b1, b0 * h.cols, min(b1 * h.cols, h.numel) - b0 * h.cols) for b0, b1 in bounds]


def grid(h: SketchHashes, b0: int, b1: int, n: int) -> tuple[Tensor, Tensor]:
    """Buckets (``offset + shift``, into a doubled table) and signs of the ``n`` coordinates from block ``b0``."""
    rows = h.shifts_t.shape[0]
    offsets = torch.arange(h.cols, device=h.shifts_t.device)
    bucket = (h.shifts_t[:, b0:b1].unsqueeze(-1) + offsets).view(rows, -1)[:, :n]
    signs = h.signs_t[:, b0:b1].unsqueeze(-1).expand(rows, b1 - b0, h.cols).reshape(rows, -1)[:, :n]
    return bucket, signs


def buckets(h: SketchHashes, idx: Tensor) -> tuple[Tensor, Tensor]:
    """The ``(rows, n)`` buckets and signs of the coordinates ``idx``."""
    block = torch.div(idx, h.cols, rounding_mode="floor")
    offset = idx - block * h.cols
    bucket = h.shifts_t.index_select(1, block).add_(offset).remainder_(h.cols)
    return bucket, h.signs_t.index_select(1, block)


def _median3(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))


def median_of_rows(values: list[Tensor]) -> Tensor:
    """Element-wise median of an odd number of equal-size tensors (min/max networks for 3 and 5)."""
    if len(values) == 1:
        return values[0]
    if len(values) == 3:
        return _median3(*values)
    if len(values) == 5:
        a, b, c, d, e = values
        low = torch.maximum(torch.minimum(a, b), torch.minimum(c, d))
        high = torch.minimum(torch.maximum(a, b), torch.maximum(c, d))
        return _median3(e, low, high)
    return torch.stack(values).median(dim=0).values


def _majority(rows: int) -> tuple[int, int]:
    """``(bits, base)``: counting from ``base``, a majority of ``rows`` sets the ``bits`` bit (a shift, no compare)."""
    bits = rows.bit_length()
    return bits, (1 << bits) - ((rows - 1) // 2 + 1)


def heavy_blocks(table: Tensor, magnitude: Tensor, h: SketchHashes, tau: float) -> Iterator[Heavy]:
    """The coordinates that may have ``|median estimate| >= tau`` (``|table| >= tau`` in a majority of rows), block by
    block (shifted slices), with their rows' values."""
    rows, cols = magnitude.shape
    bits, base = _majority(rows)
    heavy = scratch("countsketch.heavy", magnitude.numel(), torch.bool, magnitude.device).view(rows, cols)
    torch.ge(magnitude, tau, out=heavy)
    heavy = heavy.view(torch.uint8)
    count = scratch("countsketch.count", cols, torch.uint8, magnitude.device)
    for b in range(h.blocks):
        start = b * cols
        length = min(cols, h.numel - start)
        cnt = count[:length]
        cnt.fill_(base)
        for r in range(rows):
            s = h.shifts[r][b]
            first = min(length, cols - s)
            cnt[:first].add_(heavy[r, s : s + first])
            if length > first:
                cnt[first:].add_(heavy[r, : length - first])
        offsets = cnt.bitwise_right_shift_(bits).view(torch.bool).nonzero().squeeze(1)
        if offsets.numel() == 0:
            continue
        values = []
        for r in range(rows):
            # offset o sits in bucket o + s, or o + s - cols past the end: the sorted offsets split at cols - s
            s = h.shifts[r][b]
            wrap = int(torch.searchsorted(offsets, cols - s))
            v = torch.empty(offsets.numel(), dtype=table.dtype, device=table.device)
            torch.index_select(table[r, s:], 0, offsets[:wrap], out=v[:wrap])
            if wrap < offsets.numel():
                torch.index_select(table[r], 0, offsets[wrap:] - (cols - s), out=v[wrap:])
            values.append(v.neg_() if h.signs[r][b] < 0 else v)
        yield start, offsets, values


def estimates_at_least(heavy: Iterable[Heavy], tau: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """The coordinates of ``heavy`` whose ``|median estimate| >= tau``, and that magnitude."""
    found, magnitudes = [], []
    for start, offsets, values in heavy:
        kept, est = _keep_at_least(offsets, median_of_rows(values).abs_(), tau)
        found.append(kept.add_(start))
        magnitudes.append(est)
    if not found:
        empty = torch.empty(0, device=device)
        return empty.long(), empty
    return torch.cat(found), torch.cat(magnitudes)


def _keep_at_least(offsets: Tensor, est: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    """The ``offsets`` whose ``est >= tau``, with those estimates (on CPU through NumPy)."""
    if est.device.type == "cpu":
        e = est.numpy()
        kept = np.flatnonzero(e >= tau)
        return torch.from_numpy(offsets.numpy()[kept]), torch.from_numpy(e[kept])
    keep = est >= tau
    return offsets[keep], est[keep]


def heavy_segments(table: Tensor, magnitude: Tensor, h: SketchHashes, tau: float) -> Iterator[Heavy]:
    """:func:`heavy_blocks` for short blocks: a segment's heavy-bucket counts in one gather."""
    bits, base = _majority(magnitude.shape[0])
    heavy = torch.ge(magnitude, tau).to(torch.uint8)
    heavy2 = torch.cat([heavy, heavy], dim=1)
    table2 = torch.cat([table, table], dim=1)
    for b0, b1, start, n in segments(h):
        bucket, signs = grid(h, b0, b1, n)
        cnt = heavy2.gather(1, bucket).sum(0, dtype=torch.uint8)
        offsets = cnt.add_(base).bitwise_right_shift_(bits).view(torch.bool).nonzero().squeeze(1)
        if offsets.numel():
            yield start, offsets, list(table2.gather(1, bucket[:, offsets]).mul_(signs[:, offsets]).unbind(0))
