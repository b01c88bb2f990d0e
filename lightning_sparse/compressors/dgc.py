"""DGC threshold (Lin et al., Deep Gradient Compression): a threshold from a random sample of |p|."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sparse._utils import bad_argument, check_int
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
        if isinstance(sample_fraction, bool) or not isinstance(sample_fraction, (int, float)):
            raise bad_argument("sample_fraction", sample_fraction, "expected a number in (0, 1]")
        if not 0.0 < float(sample_fraction) <= 1.0:
            raise bad_argument("sample_fraction", sample_fraction, "expected a number in (0, 1]")
        if isinstance(lower, bool) or not isinstance(lower, (int, float)) or not 0.0 < float(lower) < 1.0:
            raise bad_argument("lower", lower, "expected a number in (0, 1)")
        self.sample_fraction = float(sample_fraction)
        self.lower = float(lower)
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
        candidates = indices_at_least(p, threshold)
        return finish_exactly_k(p, k, threshold, candidates, lower=self.lower, tries=self.rounds)
