"""Random-block (Eghlidi & Jaggi): one contiguous block per tensor at a shared random offset."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor


@register_compressor
class RandomBlock(Compressor):
    """Random-block sparsification (Eghlidi & Jaggi): every rank sends the same block of ``k`` coordinates at an
    offset drawn from (seed, step, parameter), so only values are all-reduced. The block wraps around the end of the
    tensor, so every coordinate is sent with probability ``k / numel``.

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> strategy = SparseDDPStrategy(compressor=RandomBlock(), density=0.01)
    """

    name = "randomblock"
    pattern = "shared"

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        d = p.numel()
        if k >= d:
            return torch.arange(d, device=p.device)
        # drawn on the CPU whatever the device: one number, no device sync
        start = int(torch.randint(0, d, (1,), generator=ctx.shared_generator(torch.device("cpu"))))
        idx = torch.arange(start, start + k, device=p.device)
        if start + k > d:  # wrapped around the end
            idx[d - start :] -= d
        return idx
