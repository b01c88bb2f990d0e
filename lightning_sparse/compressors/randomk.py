"""Random-k: k coordinates drawn uniformly with a seed shared by all ranks; values all-reduced."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor


def random_subset(d: int, k: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """A uniformly random set of ``k`` distinct indices in ``[0, d)``, in O(k) work when k << d.

    Draws slightly more than ``k`` indices with replacement, drops repeats, and keeps a random
    ``k`` of the distinct ones (a uniform subset of a uniform subset is uniform). Deterministic
    given the generator's state, so every rank with the same seed gets the same set.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> random_subset(10, 3, g, torch.device("cpu")).unique().numel()
        3
    """
    if k >= d:
        return torch.arange(d, device=device)
    if 4 * k >= d:
        return torch.randperm(d, generator=generator, device=device)[:k]
    # Expected repeats among m draws from d are about m^2 / (2d); draw a margin above that.
    draws = k + 2 * (k * k // (2 * d)) + 64
    while True:
        distinct = torch.randint(0, d, (draws,), generator=generator, device=device).unique()
        if distinct.numel() >= k:
            pick = torch.randperm(distinct.numel(), generator=generator, device=device)[:k]
            return distinct[pick]
        draws *= 2


@register_compressor
class RandomK(Compressor):
    """Random-k sparsification: every rank sends the same ``k`` uniformly drawn coordinates (a
    generator seeded from seed, step and parameter, never the global RNG), so only the values
    are all-reduced and no indices cross the wire. Unscaled: error feedback keeps the rest.

    Example:
        >>> import torch
        >>> from lightning_sparse.compressors import CompressContext
        >>> mine, theirs = CompressContext(step=3, key=7, rank=0), CompressContext(step=3, key=7, rank=1)
        >>> torch.equal(RandomK().select(torch.randn(100), 5, mine), RandomK().select(torch.randn(100), 5, theirs))
        True
    """

    name = "randomk"
    pattern = "shared"

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        return random_subset(p.numel(), k, ctx.shared_generator(p.device), p.device)
