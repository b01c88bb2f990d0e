"""Chunked top-k (as SparseLoCo and DeMo select): the top of every chunk of a tensor, in one ``torch.topk``."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse._utils import check_int, scratch
from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor


def tail_count(per_row: int, tail: int, chunk: int) -> int:
    """Picks of a last row of ``tail`` values when a full row of ``chunk`` gives ``per_row``: its share in
    ``[1, tail]`` (0 when ``per_row`` is 0)."""
    if per_row <= 0:
        return 0
    return max(1, min(tail, round(per_row * tail / chunk)))


def _sent(numel: int, chunk: int, per_row: int) -> int:
    """What rows of ``chunk`` send of ``numel`` values at ``per_row`` a full row."""
    rows = -(-numel // chunk)
    return (rows - 1) * per_row + tail_count(per_row, numel - (rows - 1) * chunk, chunk)


@dataclass(frozen=True)
class RowLayout:
    """How :class:`ChunkTopK` picks ``k`` of ``numel`` values in ``rows`` rows of ``chunk``: ``per_row`` picks a row
    from one ``torch.topk``, ``counts`` the picks each row keeps, ``offsets`` each row's first index, ``keep`` the
    kept picks' positions (None: all).

    Example:
        >>> layout = RowLayout.of(10, 5, 4, torch.device("cpu"))
        >>> layout.rows, layout.per_row, layout.counts, layout.keep.tolist()
        (3, 2, (2, 2, 1), [0, 1, 2, 3, 4])
    """

    rows: int
    per_row: int
    counts: tuple[int, ...]
    offsets: Tensor
    keep: Tensor | None

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def of(numel: int, k: int, chunk: int, device: torch.device) -> RowLayout:
        rows = -(-numel // chunk)
        # the most per full row that sends at most k, then one more in the first rows for the rest
        low, high = 0, chunk
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if _sent(numel, chunk, mid) <= k else (low, mid - 1)
        extra = k - _sent(numel, chunk, low)
        tail = tail_count(low, numel - (rows - 1) * chunk, chunk)
        counts = tuple([low + 1] * extra + [low] * (rows - 1 - extra) + [tail])
        per_row = max(counts)
        keep = None
        if any(c != per_row for c in counts):
            picks = torch.arange(rows * per_row, device=device).view(rows, per_row)
            wanted = torch.arange(per_row, device=device) < torch.tensor(counts, device=device).unsqueeze(1)
            keep = picks[wanted]
        offsets = torch.arange(0, rows * chunk, chunk, device=device).unsqueeze(1)
        return RowLayout(rows, per_row, counts, offsets, keep)


@register_compressor
class ChunkTopK(Compressor):
    """Chunked top-k (the selection of SparseLoCo and DeMo, without DeMo's DCT): the tensor is viewed as rows of
    ``chunk`` values and each row sends its ``round(density * chunk)`` largest ``|p|``, all rows in one
    ``torch.topk``; the last, partial row sends its share (at least one). ``chunk`` >= 2: SparseLoCo's 4096; DeMo's
    32 of every 64 is ``chunk=64, density=0.5``.

    Example:
        >>> import torch
        >>> from lightning_sparse.compressors import CompressContext
        >>> c = ChunkTopK(chunk=4)
        >>> p = torch.tensor([0.1, -3.0, 2.0, 0.5, 4.0, 0.0, -1.0, 0.2, 0.3, -0.7])
        >>> c.k_for(p.numel(), 0.5)  # 2 in each full row of 4, 1 in the last row of 2
        5
        >>> c.select(p, 5, CompressContext()).sort().values
        tensor([1, 2, 4, 6, 9])
        >>> from lightning_sparse import SparseDDPStrategy
        >>> strategy = SparseDDPStrategy(compressor=ChunkTopK(chunk=1024), density=0.01)
    """

    name = "chunk_topk"
    pattern = "gather"
    at_once = "chunk"

    def __init__(self, chunk: int = 4096) -> None:
        self.chunk = check_int("chunk", chunk, minimum=2)

    def k_for(self, numel: int, density: float) -> int:
        if numel <= self.chunk:
            return super().k_for(numel, density)
        return _sent(numel, self.chunk, super().k_for(self.chunk, density))

    def row_picks(self, numel: int, k: int) -> tuple[int, ...]:
        """:class:`~lightning_sparse.compressors.base.ChunkedCompressor`: the picks of each row of :meth:`select`."""
        chunk = self.chunk
        if k >= numel:  # every value
            return tuple(min(chunk, numel - start) for start in range(0, numel, chunk))
        if numel <= chunk:
            return (max(k, 0),)
        return RowLayout.of(numel, k, chunk, torch.device("cpu")).counts

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        n, chunk = p.numel(), self.chunk
        if k >= n:
            return torch.arange(n, device=p.device)
        if k <= 0:
            return torch.empty(0, dtype=torch.long, device=p.device)
        if n <= chunk:
            return torch.topk(p.abs(), k, sorted=False).indices
        layout = RowLayout.of(n, k, chunk, p.device)
        size = layout.rows * chunk
        a = scratch("chunk_topk.abs", size, p.dtype, p.device)
        torch.abs(p, out=a[:n])
        if size > n:
            a[n:].fill_(-1.0)  # the last row's padding: below every magnitude, never picked
        # sorted where a row keeps fewer than it picked: its first picks are its largest
        top = torch.topk(a.view(layout.rows, chunk), layout.per_row, dim=1, sorted=layout.keep is not None)
        idx = top.indices.add_(layout.offsets).view(-1)
        return idx if layout.keep is None else idx.index_select(0, layout.keep)
