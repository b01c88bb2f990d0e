"""rTop-k (Barnes et al.): a uniformly random k-subset of the top r = r_factor * k coordinates."""

from __future__ import annotations

import math

from torch import Tensor

from lightning_sparse._utils import bad_argument
from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor
from lightning_sparse.compressors.randomk import random_subset
from lightning_sparse.compressors.topk import exact_topk_indices


@register_compressor
class RTopK(Compressor):
    """rTop-k sparsification (Barnes, Inan, Isik, Ozgur): a random ``k`` (per rank) of the ``r = ceil(r_factor * k)``
    largest ``|p|``; values and indices all-gathered.

    Args:
        r_factor: ``r / k``, a number >= 1.

    Example:
        >>> import torch
        >>> from lightning_sparse.compressors import CompressContext
        >>> idx = RTopK(r_factor=4.0).select(torch.arange(100.0), 5, CompressContext())
        >>> idx.numel(), bool((idx >= 80).all())  # 5 of the 20 largest
        (5, True)
    """

    name = "rtopk"
    pattern = "gather"

    def __init__(self, r_factor: float = 4.0) -> None:
        if isinstance(r_factor, bool) or not isinstance(r_factor, (int, float)):
            raise bad_argument("r_factor", r_factor, "expected a finite number >= 1")
        if not (math.isfinite(r_factor) and r_factor >= 1.0):
            raise bad_argument("r_factor", r_factor, "expected a finite number >= 1")
        self.r_factor = float(r_factor)

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        d = p.numel()
        r = min(d, max(k, math.ceil(self.r_factor * k - 1e-9)))
        generator = ctx.local_generator(p.device)
        top_r = exact_topk_indices(p, r, generator)
        if r == k:
            return top_r
        return top_r[random_subset(r, k, generator, p.device)]
