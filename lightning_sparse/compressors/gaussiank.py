"""Gaussian-k (Shi et al.): a magnitude threshold from the mean and standard deviation of p."""

from __future__ import annotations

import math
from statistics import NormalDist

import torch
from torch import Tensor

from lightning_sparse._utils import check_int
from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor
from lightning_sparse.compressors.topk import finish_exactly_k, indices_at_least, top_by_magnitude


def gaussian_threshold(p: Tensor, k: int) -> float:
    """``|mu| + sigma * Phi^-1(1 - k / 2d)``: where ``k`` entries would lie above if ``p`` were Gaussian."""
    d = p.numel()
    x = p if p.dtype == torch.float32 else p.float()
    mean = float(x.sum()) / d
    var = max(float(torch.dot(x, x)) / d - mean * mean, 0.0)
    z = NormalDist().inv_cdf(1.0 - k / (2.0 * d))
    return abs(mean) + math.sqrt(var) * z


def refit_threshold(threshold: float, count: int, target: float, d: int) -> float | None:
    """The threshold at which about ``target`` of ``d`` magnitudes would pass, ``count`` passing ``threshold``: a
    zero-mean normal tail refitted to that count. None when the count says nothing (0, or ``d / 2`` or more)."""
    if count <= 0 or 2 * count >= d or not 0 < target < d:
        return None
    inv = NormalDist().inv_cdf
    return threshold * inv(1.0 - target / (2.0 * d)) / inv(1.0 - count / (2.0 * d))


def _step(threshold: float, count: int, k: int, d: int, factor: float) -> float:
    """The next threshold: refitted to ``count`` when that moves it the way ``factor`` would, else times ``factor``."""
    refit = refit_threshold(threshold, count, _AIM * k, d)
    if refit is not None and (refit < threshold if factor < 1 else refit > threshold):
        return refit
    return threshold * factor


#: the refit aims this far above k: extra entries are trimmed at no cost, too few cost a pass over p
_AIM = 1.25


@register_compressor
class GaussianK(Compressor):
    """Gaussian-k sparsification (Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning"): a
    threshold ``|mu| + sigma * Phi^-1(1 - k / 2d)`` as if ``p`` were Gaussian, refined up to ``rounds`` times while
    the count is outside ``[2k/3, 4k/3]`` (refitting a normal tail to the count, not the authors' fixed steps),
    then trimmed or padded to the top-``k`` of ``|p|`` (``rounds=0``: the Gaussian estimate only).

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> strategy = SparseDDPStrategy(compressor=GaussianK(rounds=3), density=0.01)
    """

    name = "gaussiank"
    pattern = "gather"

    def __init__(self, rounds: int = 3) -> None:
        self.rounds = check_int("rounds", rounds, minimum=0, maximum=100)

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        d = p.numel()
        if k >= d:
            return torch.arange(d, device=p.device)
        threshold = gaussian_threshold(p, k)
        if not (math.isfinite(threshold) and threshold > 0):  # constant or non-finite p
            return torch.topk(p.abs(), k, sorted=False).indices
        candidates = indices_at_least(p, threshold)
        magnitudes: Tensor | None = None
        for _ in range(self.rounds):
            count = candidates.numel()
            if count < 2 * k / 3:
                threshold = _step(threshold, count, k, d, 0.5)
                candidates, magnitudes = indices_at_least(p, threshold), None
            elif count > 4 * k / 3:
                # a higher threshold filters the shortlist (no pass over p); short of k, trim the shortlist
                higher = _step(threshold, count, k, d, 1.5)
                if magnitudes is None:
                    magnitudes = p[candidates].abs()
                keep = magnitudes >= higher
                if int(keep.sum()) < k:
                    break
                threshold, candidates, magnitudes = higher, candidates[keep], magnitudes[keep]
            else:
                break
        count = candidates.numel()
        if count >= k:
            return top_by_magnitude(p, candidates, k, magnitudes)
        # padding: lower to where the refitted tail puts 1.25 k; the fixed steps when the count has no scale
        refit = refit_threshold(threshold, count, _AIM * k, d)
        if refit is not None and refit < threshold:
            lower, tries = max(refit / threshold, 0.5), 16
        else:
            lower, tries = (0.9, 16) if count >= 2 * k / 3 else (0.5, 8)
        return finish_exactly_k(p, k, threshold, candidates, lower=lower, tries=tries)
