"""rTop-k (Barnes et al.): a uniformly random k-subset of the top r = r_factor * k coordinates."""

from __future__ import annotations

import math

from torch import Tensor

from lightning_sparse._utils import check_number
from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor
from lightning_sparse.compressors.randomk import random_subset
from lightning_sparse.compressors.topk import exact_topk_indices


@register_compressor
class RTopK(Compressor):
    """rTop-k sparsification (Barnes, Inan, Isik, Ozgur): a random ``k`` (per rank) of the ``r = ceil(r_factor * k)``
    largest ``|p|`` (``r_factor >= 1``); values and indices all-gathered.

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
        self.r_factor = check_number("r_factor", r_factor, "expected a finite number >= 1", lambda v: v >= 1.0)

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        d = p.numel()
        r = min(d, max(k, math.ceil(self.r_factor * k - 1e-9)))
        generator = ctx.local_generator(p.device)
        top_r = exact_topk_indices(p, r, generator)
        if r == k:
            return top_r
        return top_r[random_subset(r, k, generator, p.device)]
