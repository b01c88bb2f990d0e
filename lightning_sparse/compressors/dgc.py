"""DGC threshold (Lin et al., Deep Gradient Compression): a threshold from a random sample of |p|."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sparse._utils import check_int, check_number
from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor
from lightning_sparse.compressors.topk import finish_exactly_k, indices_at_least, sample_threshold


@register_compressor
class DGC(Compressor):
    """DGC's sampled-threshold selection (Lin et al., "Deep Gradient Compression"): a threshold at the top ``k/d`` of
    a random sample of ``|p|``, one shortlisting pass, then exactly the top-``k`` of ``|p|`` (too many trimmed by
    magnitude, too few padded by lowering the threshold up to ``rounds`` times, then ``torch.topk``).

    Args:
        sample_fraction: share of the entries sampled, in (0, 1] (at least 1,024, or all of a smaller tensor).
        lower: factor applied to the threshold when fewer than ``k`` entries pass, in (0, 1).
        rounds: most threshold lowerings before falling back to ``torch.topk``.

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> strategy = SparseDDPStrategy(compressor=DGC(sample_fraction=0.01), density=0.001)
    """

    name = "dgc"
    pattern = "gather"

    def __init__(self, sample_fraction: float = 0.01, lower: float = 0.8, rounds: int = 10) -> None:
        fraction_allowed = "expected a number in (0, 1]"
        self.sample_fraction = check_number("sample_fraction", sample_fraction, fraction_allowed, lambda v: 0 < v <= 1)
        self.lower = check_number("lower", lower, "expected a number in (0, 1)", lambda v: 0 < v < 1)
        self.rounds = check_int("rounds", rounds, minimum=0, maximum=1000)

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        d = p.numel()
        if k >= d:
            return torch.arange(d, device=p.device)
        n = min(d, max(1024, math.ceil(self.sample_fraction * d)))
        # two standard deviations below DGC's own quantile, which falls short half of the time
        threshold = sample_threshold(p, k, n, ctx.local_generator(p.device), margin=2.0)
        if not (math.isfinite(threshold) and threshold > 0):
            return torch.topk(p.abs(), k, sorted=False).indices
        return finish_exactly_k(p, k, threshold, indices_at_least(p, threshold), lower=self.lower, tries=self.rounds)
