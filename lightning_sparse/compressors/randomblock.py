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
    """Random-block sparsification (Eghlidi & Jaggi, "Sparse Communication for Training Deep
    Networks"): every rank sends the same contiguous block of ``k`` coordinates, starting at an
    offset drawn from a generator seeded by (seed, step, parameter), so the values are
    all-reduced and no indices cross the wire.

    The block wraps around the end of the tensor (``[s, s + k)`` modulo ``numel``, ``s``
    uniform): every coordinate is then sent with the same probability ``k / numel`` per step,
    whereas a block kept inside the tensor would reach its first and last coordinates almost
    never, and their error-feedback residual would grow without bound.

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
        # The offset is drawn on the CPU whatever the device: one number, no device sync.
        start = int(torch.randint(0, d, (1,), generator=ctx.shared_generator(torch.device("cpu"))))
        return block_indices(d, k, start, p.device)
