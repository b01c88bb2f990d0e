"""Top-k: send the k coordinates of largest magnitude, with a fast exact selection."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sparse._utils import scratch
from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor

# Below this size (or above this density) torch.topk is as fast as anything else.
_SMALL = 1 << 16
_DENSE_FRACTION = 0.125


def exact_topk_indices(p: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """Indices of the ``k`` entries of largest ``|p|``: the same set ``torch.topk`` finds (up to ties).

    On large tensors it first estimates the magnitude threshold of the k-th entry from a random
    sample, shortlists the entries at or above it with one pass, and runs ``torch.topk`` on the
    shortlist only. The sample threshold is chosen a few standard deviations low, so the shortlist
    holds at least ``k`` entries almost always; when it does not, it falls back to ``torch.topk``
    over everything. Either way the result is exact. ``generator`` drives the sample only.

    Example:
        >>> import torch
        >>> exact_topk_indices(torch.tensor([0.5, -4.0, 1.0, 3.0]), 2).sort().values
        tensor([1, 3])
    """
    d = p.numel()
    if k >= d:
        return torch.arange(d, device=p.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=p.device)
    if d < _SMALL or k > _DENSE_FRACTION * d:
        return torch.topk(p.abs(), k, sorted=False).indices
    a = torch.abs(p, out=scratch("topk.abs", d, p.dtype, p.device))
    # Aim for ~64 sample entries above the true threshold: the estimate's relative error is then
    # ~1/8, and a threshold 4 standard deviations low shortlists ~1.5k entries.
    n = min(d, max(4096, math.ceil(64 * d / k)))
    sample = a[torch.randint(0, d, (n,), generator=generator, device=p.device)]
    expected = n * k / d
    j = min(n, math.ceil(expected + 4.0 * math.sqrt(expected) + 8))
    threshold = torch.topk(sample, j, sorted=False).values.min()
    if threshold.item() > 0:
        mask = torch.ge(a, threshold, out=scratch("topk.mask", d, torch.bool, p.device))
        candidates = mask.nonzero().squeeze(1)
        if candidates.numel() >= k:
            return candidates[torch.topk(a[candidates], k, sorted=False).indices]
    return torch.topk(a, k, sorted=False).indices


@register_compressor
class TopK(Compressor):
    """Top-k sparsification: each rank sends its ``k`` largest-magnitude coordinates of
    gradient + residual (values and int32 indices, all-gathered).

    Args:
        fast: use the sample-threshold shortlist selection (exact, several times faster than
            ``torch.topk`` on large tensors); ``False`` always calls ``torch.topk``.

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> strategy = SparseDDPStrategy(compressor=TopK(), density=0.01)
    """

    name = "topk"
    pattern = "gather"

    def __init__(self, fast: bool = True) -> None:
        if not isinstance(fast, bool):
            raise ValueError(f"fast={fast!r} is not allowed: expected True or False.")
        self.fast = fast

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        if not self.fast:
            return torch.topk(p.abs(), min(k, p.numel()), sorted=False).indices
        return exact_topk_indices(p, k, ctx.local_generator(p.device))
