"""Top-k: the k coordinates of largest magnitude, found fast and exactly; and the shared threshold machinery."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from lightning_sparse._utils import check_bool, scratch
from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor

# Below this size (or above this density) torch.topk is as fast as anything else.
_SMALL = 1 << 16
_DENSE_FRACTION = 0.125
_CHUNK = 1 << 17  # on CPU, shortlisting goes in cache-sized chunks: one read of p instead of three passes
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def indices_at_least(p: Tensor, threshold: float) -> Tensor:
    """Sorted int64 indices of the entries with ``|p| >= threshold`` (one pass over ``p``; on CPU through NumPy)."""
    d = p.numel()
    if d == 0:
        return torch.empty(0, dtype=torch.long, device=p.device)
    chunk = min(_CHUNK if p.device.type == "cpu" else d, d)
    a = scratch("shortlist.abs", chunk, p.dtype, p.device)
    mask = scratch("shortlist.mask", chunk, torch.bool, p.device)
    numpy = p.device.type == "cpu" and p.dtype in _NUMPY_DTYPES and p.is_contiguous()
    if numpy:
        x, a_np, mask_np = p.detach().numpy(), a.numpy(), mask.numpy()
    parts = []
    for start in range(0, d, chunk):
        n = min(chunk, d - start)
        if numpy:
            np.greater_equal(np.abs(x[start : start + n], out=a_np[:n]), threshold, out=mask_np[:n])
            idx = torch.from_numpy(np.flatnonzero(mask_np[:n]))
        else:
            torch.ge(torch.abs(p[start : start + n], out=a[:n]), threshold, out=mask[:n])
            idx = mask[:n].nonzero().squeeze(1)
        if idx.numel():
            parts.append(idx.add_(start) if start else idx)
    if not parts:
        return torch.empty(0, dtype=torch.long, device=p.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def top_by_magnitude(p: Tensor, candidates: Tensor, k: int, magnitudes: Tensor | None = None) -> Tensor:
    """The ``k`` entries of ``candidates`` (indices into ``p``) with the largest ``|p|`` (or ``magnitudes``)."""
    if candidates.numel() == k:
        return candidates
    if magnitudes is None:
        magnitudes = p[candidates].abs()
    return candidates[largest(magnitudes, k)]


def largest(values: Tensor, k: int, smallest: bool = False) -> Tensor:
    """Positions of the ``k`` largest (``smallest=True``: smallest) entries of a 1-D tensor, in no order (on CPU
    through NumPy's introselect).

    Example:
        >>> import torch
        >>> largest(torch.tensor([0.5, 4.0, 1.0, 3.0]), 2).sort().values
        tensor([1, 3])
        >>> largest(torch.tensor([0.5, 4.0, 1.0, 3.0]), 2, smallest=True).sort().values
        tensor([0, 2])
    """
    n = values.numel()
    if values.device.type == "cpu" and values.dtype in _NUMPY_DTYPES and 0 < k < n and values.is_contiguous():
        x = values.detach().numpy()
        picked = np.argpartition(x, k - 1)[:k] if smallest else np.argpartition(x, n - k)[n - k :]
        return torch.from_numpy(picked)
    return torch.topk(values, k, largest=not smallest, sorted=False).indices


def sample_threshold(p: Tensor, k: int, n: int, generator: torch.Generator | None, margin: float) -> float:
    """Estimate the ``k``-th largest of ``|p|`` from ``n`` entries drawn with ``generator``, ``margin`` standard
    deviations of the sampled count lower (so that ``k`` pass almost always)."""
    d = p.numel()
    sample = p[torch.randint(0, d, (n,), generator=generator, device=p.device)].abs()
    return float(torch.topk(sample, sample_rank(n, k, d, margin), sorted=False).values.min())


def sample_rank(n: int, k: int, d: int, margin: float) -> int:
    """Rank in a uniform sample of ``n`` out of ``d`` values that estimates the ``k``-th largest."""
    expected = n * k / d
    return min(n, max(1, math.ceil(expected + margin * math.sqrt(expected) + (8 if margin > 0 else 0))))


def exact_topk_indices(p: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """Indices of the ``k`` entries of largest ``|p|`` (the set ``torch.topk`` finds, up to ties): on large tensors a
    threshold from a random sample, one shortlisting pass, ``torch.topk`` on the shortlist."""
    d = p.numel()
    if k >= d:
        return torch.arange(d, device=p.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=p.device)
    if d < _SMALL or k > _DENSE_FRACTION * d:
        return torch.topk(p.abs(), k, sorted=False).indices
    # ~64 sample entries above the true threshold: ~1/8 relative error; 4 deviations low shortlists ~1.5k
    n = min(d, max(4096, math.ceil(64 * d / k)))
    threshold = sample_threshold(p, k, n, generator, margin=4.0)
    if threshold > 0:
        candidates = indices_at_least(p, threshold)
        if candidates.numel() >= k:
            return top_by_magnitude(p, candidates, k)
    return torch.topk(p.abs(), k, sorted=False).indices


def finish_exactly_k(p: Tensor, k: int, threshold: float, candidates: Tensor, lower: float, tries: int = 8) -> Tensor:
    """Turn a threshold shortlist into exactly the top-``k`` of ``|p|``: too many are trimmed by magnitude; too few,
    the threshold is lowered (``*= lower``) up to ``tries`` times, then ``torch.topk``."""
    while candidates.numel() < k and tries > 0 and threshold > 0:
        threshold *= lower
        candidates = indices_at_least(p, threshold)
        tries -= 1
    if candidates.numel() < k:
        return torch.topk(p.abs(), k, sorted=False).indices
    return top_by_magnitude(p, candidates, k)


@register_compressor
class TopK(Compressor):
    """Top-k sparsification: each rank sends its ``k`` largest-magnitude coordinates of gradient + residual, found
    exactly by a sample-threshold shortlist (``fast=False``: always by ``torch.topk``).

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> strategy = SparseDDPStrategy(compressor=TopK(), density=0.01)
    """

    name = "topk"
    pattern = "gather"
    at_once = "topk"

    def __init__(self, fast: bool = True) -> None:
        self.fast = check_bool("fast", fast)

    def selects_at_once(self, rule: str) -> bool:
        return self.fast and super().selects_at_once(rule)  # the at-once rule is the shortlist's

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        if not self.fast:
            return torch.topk(p.abs(), min(k, p.numel()), sorted=False).indices
        return exact_topk_indices(p, k, ctx.local_generator(p.device))
