"""Count-sketch (Sketched SGD, Ivkin et al.): heavy hitters of the summed gradient from summed sketches.

Row ``r`` sends coordinate ``j = b * cols + o`` (block ``b``) to bucket ``(o + shift[r, b]) mod cols`` with sign
``sign[r, b]``, drawn per (row, block) from the shared generator: unbiased estimates, sketched by a few shifted
slice-adds per block. The exchange (:mod:`lightning_sparse.wire.sketch`) draws its hashes per bucket.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from lightning_sparse._utils import bad_argument, check_int, check_number, scratch
from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor
from lightning_sparse.compressors.sketch_hashes import (
    SketchHashes,
    buckets,
    estimates_at_least,
    grid,
    heavy_blocks,
    heavy_segments,
    median_of_rows,
    segments,
)
from lightning_sparse.compressors.topk import largest, sample_rank, sample_threshold

#: local pre-truncation used by ``p1="auto"`` on CPU (sketch only the top ``p1 * k`` of p)
AUTO_P1_CPU = 10.0
_CHUNK = 1 << 17  # on CPU, per-block work goes in chunks that stay in cache
_DIRECT = 1 << 20  # up to rows * numel = _DIRECT, candidates come from all the estimates at once
_LONG_BLOCK = 1 << 14  # blocks at least this long go one by one with slice-adds, shorter ones by segments


@register_compressor
class CountSketch(Compressor):
    """Count-sketch compression (Ivkin et al., "Communication-efficient Distributed SGD with Sketching").

    The ranks' sketches are all-reduced; every rank takes the ``p2 * k`` coordinates of largest median estimate as
    candidates, a second all-reduce sums the exact ``p`` there and the ``k`` largest sums are applied. With
    pre-truncation (the authors' ``p1``) a rank sketches only about its top ``p1 * k`` entries.

    Args:
        rows: rows of the sketch, an odd integer.
        width: columns per selected coordinate: ``cols = ceil(width * k)`` (at most numel).
        p2: candidates per selected coordinate in the second round (``ceil(p2 * k)``), >= 1.
        p1: local pre-truncation: ``"auto"`` (10 on CPU, 0 elsewhere), 0 (off) or a number >= 1.

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> strategy = SparseDDPStrategy(compressor=CountSketch(rows=5, width=10.0), density=0.001)
    """

    name = "countsketch"
    pattern = "sketch"
    at_once = "countsketch"

    def __init__(
        self, rows: int = 5, width: float = 10.0, p2: float = 4.0, p1: float | Literal["auto"] = "auto"
    ) -> None:
        self.rows = check_int("rows", rows, minimum=1, maximum=99)
        if self.rows % 2 == 0:
            raise bad_argument("rows", rows, "expected an odd integer between 1 and 99")
        self.width = check_number("width", width, "expected a finite number > 0", lambda v: v >= 1e-9)
        self.p2 = check_number("p2", p2, "expected a finite number >= 1", lambda v: v >= 1.0)
        if p1 != "auto":
            allowed = "expected 'auto', 0 (no pre-truncation) or a finite number >= 1"
            p1 = check_number("p1", p1, allowed, lambda v: v == 0.0 or v >= 1.0)
        self.p1 = p1

    def table_shape(self, numel: int, k: int) -> tuple[int, int]:
        return self.rows, max(1, min(numel, math.ceil(self.width * k)))

    def num_candidates(self, numel: int, k: int) -> int:
        return min(numel, max(k, math.ceil(self.p2 * k)))

    def truncation(self, device: torch.device) -> float:
        if self.p1 == "auto":
            return AUTO_P1_CPU if device.type == "cpu" else 0.0
        return float(self.p1)

    def hashes(self, ctx: CompressContext, numel: int, cols: int, device: torch.device) -> SketchHashes:
        """The hash parameters shared by all ranks for this (seed, step, parameter)."""
        blocks = max(1, -(-numel // cols))
        gen = ctx.shared_generator(torch.device("cpu"))  # host draws: identical on any device
        shifts = torch.randint(0, cols, (self.rows, blocks), generator=gen)
        signs = torch.randint(0, 2, (self.rows, blocks), generator=gen).mul_(2).sub_(1).float()
        return SketchHashes(cols, numel, shifts.tolist(), signs.tolist(), shifts.to(device), signs.to(device), gen)

    def sketch(self, p: Tensor, k: int, ctx: CompressContext, table: Tensor) -> None:
        """Add this rank's ``p`` (or its top ``p1 * k``) into ``table``."""
        d = p.numel()
        rows, cols = table.shape
        if rows != self.rows:
            raise ValueError(f"table has {rows} rows, expected {self.rows}")
        h = self.hashes(ctx, d, cols, p.device)
        m = math.ceil(self.truncation(p.device) * k)
        threshold = None
        if 0 < m < d:
            n = min(d, max(4096, math.ceil(64 * d / m)))
            threshold = sample_threshold(p, m, n, ctx.local_generator(p.device), margin=0.0)
            if not threshold > 0:  # mostly zeros: sketching everything adds only the non-zeros
                threshold = None
        # long blocks: shifted slice-adds, no index tensors at all; many short ones: scatter-adds over segments
        (_sketch_slices if cols >= _LONG_BLOCK else _sketch_segments)(table, h, p, threshold)

    def estimates(self, table: Tensor, h: SketchHashes, idx: Tensor) -> Tensor:
        """Median-over-rows estimates of the sketched vector at the coordinates ``idx``."""
        bucket, signs = buckets(h, idx)
        return median_of_rows(list(table.gather(1, bucket).mul_(signs).unbind(0)))

    def candidates(self, table: Tensor, numel: int, k: int, ctx: CompressContext) -> Tensor:
        """Sorted indices of the ``num_candidates`` largest estimates; the same on every rank (summed table)."""
        rows, cols = table.shape
        c = self.num_candidates(numel, k)
        if c >= numel:
            return torch.arange(numel, device=table.device)
        h = self.hashes(ctx, numel, cols, table.device)
        if rows * numel <= _DIRECT:  # small tensors: every estimate at once, in bounded memory
            bucket, signs = grid(h, 0, h.blocks, numel)
            values = torch.cat([table, table], dim=1).gather(1, bucket).mul_(signs)
            est = median_of_rows(list(values.unbind(0))).abs_()
            return torch.topk(est, c, sorted=False).indices.sort().values
        magnitude = scratch("countsketch.magnitude", table.numel(), table.dtype, table.device).view(rows, cols)
        torch.abs(table, out=magnitude)
        if float(magnitude.max()) == 0.0:  # nothing was sketched: any c coordinates will do
            return torch.arange(c, device=table.device)
        tau = self._sample_tau(table, h, c)
        heavy = heavy_blocks if cols >= _LONG_BLOCK else heavy_segments
        for _ in range(4):
            if not tau > 0:
                break
            found, magnitudes = estimates_at_least(heavy(table, magnitude, h, tau), tau, table.device)
            if found.numel() >= c:
                return _largest_in_order(found, magnitudes, c)
            tau *= 0.25
        return self._scan_all(table, h, c)

    def _sample_tau(self, table: Tensor, h: SketchHashes, c: int) -> float:
        """A threshold a little below the ``c``-th largest ``|estimate|``, sampled alike on every rank."""
        d = h.numel
        n = min(d, max(4096, math.ceil(256 * d / c)), 1 << 16)  # ~256 expected above: +-6% on tau
        j = sample_rank(n, c, d, margin=4.0)
        best = torch.empty(0, device=table.device)
        for start in range(0, n, 1 << 14):
            idx = torch.randint(0, d, (min(1 << 14, n - start),), generator=h.generator).to(table.device)
            best = torch.cat([best, self.estimates(table, h, idx).abs_()])
            if best.numel() > j:
                best = torch.topk(best, j, sorted=False).values
        return float(best.min())

    def _scan_all(self, table: Tensor, h: SketchHashes, c: int) -> Tensor:
        """Exact top-``c`` estimates by a scan of every coordinate (the fallback)."""
        chunk = max(c, 1 << 16)
        best_idx = torch.empty(0, dtype=torch.long, device=table.device)
        best_val = torch.empty(0, dtype=torch.float32, device=table.device)
        for start in range(0, h.numel, chunk):
            idx = torch.arange(start, min(h.numel, start + chunk), device=table.device)
            val = self.estimates(table, h, idx).abs_()
            idx, val = torch.cat([best_idx, idx]), torch.cat([best_val, val])
            top = torch.topk(val, min(c, val.numel()), sorted=False).indices
            best_idx, best_val = idx[top], val[top]
        return best_idx.sort().values

    @staticmethod
    def pick(sums: Tensor, k: int) -> Tensor:
        """Positions of the ``k`` largest ``|sums|``."""
        if k >= sums.numel():
            return torch.arange(sums.numel(), device=sums.device)
        return torch.topk(sums.float().abs(), k, sorted=False).indices

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        """The exchange on one process: sketch ``p``, find candidates, keep the top-k exact values."""
        d = p.numel()
        if k >= d:
            return torch.arange(d, device=p.device)
        rows, cols = self.table_shape(d, k)
        table = scratch("countsketch.table", rows * cols, torch.float32, p.device).view(rows, cols).zero_()
        self.sketch(p, k, ctx, table)
        cand = self.candidates(table, d, k, ctx)
        return cand[self.pick(p[cand], k)]


def _sketch_segments(table: Tensor, h: SketchHashes, p: Tensor, threshold: float | None) -> None:
    """Add ``p`` into ``table`` when blocks are short: a scatter-add per segment into a doubled table."""
    rows, cols = table.shape
    wide = torch.zeros(rows, 2 * cols, dtype=table.dtype, device=table.device)
    for b0, b1, start, n in segments(h):
        x = p[start : start + n]
        if threshold is not None:
            x = torch.nn.functional.hardshrink(x, threshold)
        bucket, signs = grid(h, b0, b1, n)
        wide.scatter_add_(1, bucket, signs * x.float())
    table += wide[:, :cols]
    table += wide[:, cols:]


def _sketch_slices(table: Tensor, h: SketchHashes, p: Tensor, threshold: float | None) -> None:
    """Add ``p`` (only ``|p| > threshold`` with a threshold) into ``table`` by shifted slice-adds per block."""
    rows, cols = table.shape
    d = p.numel()
    chunk = min(cols, _CHUNK if p.device.type == "cpu" else cols)
    if threshold is not None:
        kept = scratch("countsketch.chunk_kept", chunk, p.dtype, p.device)
    for b in range(h.blocks):
        start = b * cols
        length = min(cols, d - start)
        for offset in range(0, length, chunk):
            part = p[start + offset : start + min(length, offset + chunk)]
            n = part.numel()
            if threshold is not None:
                # hardshrink zeroes |p| <= threshold in one fused pass
                part = torch.ops.aten.hardshrink.out(part, threshold, out=kept[:n])
            for r in range(rows):
                pos = offset + h.shifts[r][b]
                if pos >= cols:
                    pos -= cols
                first = min(n, cols - pos)
                sign = h.signs[r][b]
                table[r, pos : pos + first].add_(part[:first], alpha=sign)
                if n > first:
                    table[r, : n - first].add_(part[first:], alpha=sign)


def _largest_in_order(found: Tensor, magnitudes: Tensor, c: int) -> Tensor:
    """The ``c`` entries of the sorted ``found`` with the largest ``magnitudes``, still sorted."""
    extra = found.numel() - c
    if extra <= 0:
        return found
    keep = torch.ones(found.numel(), dtype=torch.bool, device=found.device)
    keep[largest(magnitudes, extra, smallest=True)] = False
    return found[keep]
