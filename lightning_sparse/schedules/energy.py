"""The top-k energy estimate: ``||Top_k(p)||^2`` of one tensor at many ``k`` at once."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_sparse._utils import scratch

_EXACT_NUMEL = 1 << 16  # tensors up to this size get their exact top-k energy curve (one sort)
_BINS_PER_OCTAVE = 16  # larger ones: a histogram of p^2 in bins 2**(1/16) wide, over ...
_OCTAVES = 64  # ... the 64 octaves below max(p^2) (everything smaller shares the lowest bin)
_SHORTLIST = 4096  # and the exact curve of (about) the largest 4096 entries


def topk_energy(p: Tensor, ks: Sequence[int]) -> Tensor:
    """``||Top_k(p)||^2`` for each ``k`` in ``ks``, and ``||p||^2`` last (float64, on p's device).

    Exact up to 65,536 elements (one sort). Above, each edge of a log-scale histogram of ``p^2`` is an exact point
    of the curve, interpolated linearly in between; the largest few thousand entries are sorted, exact.
    """
    d = p.numel()
    dev = p.device
    x = p.detach().reshape(-1)
    kt = torch.tensor([min(max(int(k), 1), d) for k in ks], dtype=torch.long, device=dev)
    if d <= _EXACT_NUMEL:
        a2 = x.float().square()
        total = a2.sum(dtype=torch.float64).reshape(1)
        curve = a2.sort(descending=True).values.cumsum(0, dtype=torch.float64)
        return torch.cat([curve[kt - 1], total])
    # reused buffers: fresh multi-MB allocations every step cost page faults
    a2 = scratch("energy.sq", d, torch.float32, dev)
    torch.mul(x, x, out=a2) if x.dtype == torch.float32 else a2.copy_(x).square_()
    total = a2.sum().double().reshape(1)  # a float32 (pairwise) sum
    nb = _BINS_PER_OCTAVE * _OCTAVES
    # bin = floor(S * (log2(a2) - log2(max a2)) + nb), clamped to [0, nb - 1]: monotone in a2
    v = torch.log2(a2, out=scratch("energy.bin", d, torch.float32, dev))
    v.mul_(_BINS_PER_OCTAVE).add_(nb - _BINS_PER_OCTAVE * torch.log2(a2.max()))
    torch.nan_to_num_(v, nan=0.0, posinf=nb - 1, neginf=0.0).clamp_(0, nb - 1)
    bins = v.to(torch.int32)
    counts = torch.bincount(bins, minlength=nb).to(torch.float64)
    energy = torch.bincount(bins, weights=a2, minlength=nb).to(torch.float64)
    # entries in bins >= j: the top-c entries; points from the highest bin edge down to all of p
    above_c, above_e = counts.flip(0).cumsum(0), energy.flip(0).cumsum(0)
    zero = torch.zeros(1, dtype=torch.float64, device=dev)
    curve = _interp(kt.to(torch.float64), torch.cat([zero, above_c]), torch.cat([zero, above_e]))
    # interpolation is coarsest at small k: the exact curve of the largest few thousand (whole bins)
    top_bins = min(nb - 1, int(torch.searchsorted(above_c, torch.tensor([float(_SHORTLIST)], device=dev).double())))
    if float(above_c[top_bins]) <= 16 * _SHORTLIST:  # (unless a top bin is crowded: then interpolate)
        shortlist = a2[bins >= nb - 1 - top_bins]
        exact = shortlist.sort(descending=True).values.cumsum(0, dtype=torch.float64)
        curve = torch.where(kt <= exact.numel(), exact[(kt - 1).clamp(max=exact.numel() - 1)], curve)
    return torch.cat([curve, total])


def _interp(q: Tensor, xs: Tensor, ys: Tensor) -> Tensor:
    """Piecewise-linear interpolation of (xs ascending, ys) at q, on the tensors' device."""
    hi = torch.searchsorted(xs, q, right=False).clamp(1, xs.numel() - 1)
    x0, x1, y0, y1 = xs[hi - 1], xs[hi], ys[hi - 1], ys[hi]
    span = x1 - x0
    w = torch.where(span > 0, (q - x0) / span.clamp(min=1e-300), torch.ones_like(q))
    return y0 + w.clamp(0.0, 1.0) * (y1 - y0)
