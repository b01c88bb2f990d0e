"""Random-block (Eghlidi & Jaggi): one contiguous block per tensor at a shared random offset."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor


def block_indices(d: int, k: int, start: int, device: torch.device) -> Tensor:
    """The block ``[start, start + k)`` of ``[0, d)``, wrapping around the end of the tensor.

    Example:
        >>> block_indices(10, 4, 8, torch.device("cpu"))
        tensor([8, 9, 0, 1])
    """
    idx = torch.arange(start, start + k, device=device)
    if start + k > d:
        idx[d - start :] -= d
    return idx


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
        return block_indices(d, k, start, p.device)
