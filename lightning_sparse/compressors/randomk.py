"""Random-k: k coordinates drawn uniformly with a seed shared by all ranks; values all-reduced.

A tensor's coordinates are a function of (seed, step, key, numel, k) alone (:func:`draw_subsets`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_sparse._utils import mix_seed
from lightning_sparse.compressors.base import CompressContext, Compressor, register_compressor

_M32 = 0xFFFFFFFF
#: a 32-bit hash of hash-prospector's lowbias32 form with multipliers below 2**31: a product with a 32-bit
#: value fits an int64, so every device gives the same bits, with no overflow
_SHIFTS = (16, 15, 15)
_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
#: the hash's three lanes per candidate: two for its value (63 bits), one for its priority
_LANE_SALTS = (0x243F6A88, 0x85A308D3, 0x13198A2E)
_WEYL = 0x9E3779B9  # a candidate's counter j enters as j * _WEYL mod 2**32 (distinct for j < 2**32)
_TAG = 0x2A4D0C
#: fewer than k distinct among a member's draws with probability below 2**-_FAIL_BITS
_FAIL_BITS = 40
#: a priority key: member (buffer order), then "a repeat" flag, then the 32-bit priority
_MEMBER_SHIFT = 44
_REPEAT = 1 << 43


def random_subset(d: int, k: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """A uniformly random set of ``k`` distinct indices in ``[0, d)`` (O(k) work when k << d), the same on every rank
    with the same generator state."""
    if k >= d:
        return torch.arange(d, device=device)
    if 4 * k >= d:
        return torch.randperm(d, generator=generator, device=device)[:k]
    # Expected repeats among m draws from d are about m^2 / (2d); draw a margin above that.
    draws = k + 2 * (k * k // (2 * d)) + 64
    while True:
        distinct = torch.randint(0, d, (draws,), generator=generator, device=device).unique()
        if distinct.numel() >= k:
            return distinct[torch.randperm(distinct.numel(), generator=generator, device=device)[:k]]
        draws *= 2


def mix32_(x: Tensor) -> Tensor:
    """Hash in place every entry of the int64 tensor ``x`` (in ``[0, 2**32)``): a bijection, the same bits on every
    device. Returns ``x``.

    Example:
        >>> mix32_(torch.tensor([0, 1, 2])).tolist()
        [0, 2261973619, 229111015]
    """
    a, b = _MULTIPLIERS
    s1, s2, s3 = _SHIFTS
    x.bitwise_xor_(x >> s1).mul_(a).bitwise_and_(_M32)
    x.bitwise_xor_(x >> s2).mul_(b).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> s3)


@functools.lru_cache(maxsize=4096)
def draws_needed(d: int, k: int) -> int | None:
    """How many uniform draws from ``[0, d)`` hold ``k`` distinct values but with probability below ``2**-40``; None
    where that many would reach ``d``."""
    if k <= 0:
        return 0
    limit = d - 1  # fewer candidates than every coordinate
    if limit < k or _log_failure(d, k, limit) > -_FAIL_BITS * math.log(2):
        return None
    lo, hi = k, k + 1
    while hi < limit and _log_failure(d, k, hi) > -_FAIL_BITS * math.log(2):
        lo, hi = hi, min(limit, k + 2 * (hi - k))
    while lo < hi:  # the smallest m in (lo, hi] that is enough (the bound falls with m)
        mid = (lo + hi) // 2
        if _log_failure(d, k, mid) <= -_FAIL_BITS * math.log(2):
            hi = mid
        else:
            lo = mid + 1
    return hi


def _log_failure(d: int, k: int, m: int) -> float:
    """ln of a bound on P(fewer than k distinct among m uniform draws from [0, d))."""
    # fewer than k distinct: at least r = m - k + 1 draws repeat an earlier one; each does with
    # probability below m / d whatever came before, and there are C(m, r) ways to place them
    r = m - k + 1
    union = math.lgamma(m + 1) - math.lgamma(r + 1) - math.lgamma(m - r + 1) + r * math.log(m / d)
    # the number of distinct values moves by at most 1 with each draw: McDiarmid
    mean = -d * math.expm1(m * math.log1p(-1.0 / d))
    gap = mean - (k - 1)
    mcdiarmid = -2.0 * gap * gap / m if gap > 0 else 0.0
    return min(union, mcdiarmid, 0.0)


@dataclass(frozen=True)
class SubsetLayout:
    """The candidates of :func:`draw_subsets` for tensors laid end to end, made once per (tensors, device).

    Example:
        >>> layout = SubsetLayout.of(((7, 0, 1000, 10), (8, 1000, 50, 40)), torch.device("cpu"))
        >>> layout.picks.numel(), layout.member_of.numel()  # 10 + 40 picks from 19 draws and 50 candidates
        (50, 69)
    """

    keys: Tensor  # (3, S): each tensor's key, salted per lane
    member_of: Tensor  # (C,): each candidate's tensor
    counter: Tensor  # (C,): its counter j within its tensor, times _WEYL (mod 2**32)
    mods: Tensor  # (2, C): d (a draw) or 1 (coordinate j) for its value, 2**32 for its priority
    bases: Tensor  # (2, C): offset (+ j), and the priority key's member part
    picks: Tensor  # (K,): where each tensor's picks lie among the ranked candidates
    last: Tensor  # (S,): where its last pick lies (ranked after a repeat: too few were distinct)
    pick_member: Tensor  # (K,): each pick's tensor
    lowest: Tensor  # (K,): each tensor's k lowest coordinates, should too few be distinct

    @staticmethod
    def of(members: tuple[tuple[int, int, int, int], ...], device: torch.device) -> SubsetLayout:
        """``members``: ``(key, offset, numel, k)`` of each tensor, by ascending offset, not overlapping, ``1 <= k``
        (the picks come out as offsets)."""
        if len(members) >= 1 << (63 - _MEMBER_SHIFT):
            raise ValueError(f"{len(members)} tensors are too many for one draw")
        member, counter, mods, bases, picks, last, pick_member, lowest = ([] for _ in range(8))
        start = 0
        for i, (_, offset, d, k) in enumerate(members):
            k = min(k, d)
            m = draws_needed(d, k)
            n = d if m is None else m  # every coordinate once, or m draws
            j = np.arange(n, dtype=np.int64)
            member.append(np.full(n, i, dtype=np.int64))
            counter.append((j.astype(np.uint64) * np.uint64(_WEYL) & np.uint64(_M32)).astype(np.int64))
            mods.append(np.full(n, 1 if m is None else d, dtype=np.int64))
            bases.append(offset + (j if m is None else np.zeros(n, dtype=np.int64)))
            picks.append(np.arange(start, start + k, dtype=np.int64))
            last.append(start + k - 1)
            pick_member.append(np.full(k, i, dtype=np.int64))
            lowest.append(offset + np.arange(k, dtype=np.int64))
            start += n

        def long(arrays: list[Any]) -> Tensor:
            return torch.from_numpy(np.concatenate(arrays).astype(np.int64)).to(device)

        member_of = long(member)
        keys = [[(key & _M32) ^ salt for key, _, _, _ in members] for salt in _LANE_SALTS]
        return SubsetLayout(
            keys=torch.tensor(keys, dtype=torch.int64, device=device),
            member_of=member_of,
            counter=long(counter),
            mods=torch.stack([long(mods), torch.full_like(member_of, 1 << 32)]),
            bases=torch.stack([long(bases), member_of << _MEMBER_SHIFT]),
            picks=long(picks),
            last=torch.tensor(last, dtype=torch.int64, device=device),
            pick_member=long(pick_member),
            lowest=long(lowest),
        )


def draw_subsets(layout: SubsetLayout, seed: int, step: int) -> Tensor:
    """Every tensor's ``k`` distinct coordinates (as offsets, ascending), drawn at once by a counter-based hash on its
    device with no host read: the distinct values among the ``k`` smallest random priorities of
    :func:`draws_needed` uniform draws (should fewer be distinct, the ``k`` lowest coordinates)."""
    # the hash of (seed, step, key) per tensor and lane, then of that and the counter per candidate
    h = torch.bitwise_xor(layout.keys, mix_seed(seed, _TAG, step) & _M32)
    h = mix32_(h).index_select(1, layout.member_of).add_(layout.counter).bitwise_and_(_M32)
    h = mix32_(h)
    drawn = h[1:]  # value (lanes 0 and 1: 63 bits) and priority (lane 2)
    drawn[0].bitwise_right_shift_(1).bitwise_or_(h[0] << 31)
    drawn.remainder_(layout.mods).add_(layout.bases)
    at, priority = drawn[0], drawn[1]
    # a value drawn again (after its first draw, in candidate order) ranks after every first draw
    at, order = torch.sort(at, stable=True)
    key = priority.index_select(0, order)
    key[1:].add_(at[1:] == at[:-1], alpha=_REPEAT)
    # each tensor's candidates keep their place when ranked: its picks lie at fixed positions
    key, rank = torch.sort(key)
    picks = at.index_select(0, rank.index_select(0, layout.picks))
    short = key.index_select(0, layout.last).bitwise_and_(_REPEAT).ne(0)  # fewer than k distinct
    picks = torch.where(short.index_select(0, layout.pick_member), layout.lowest, picks)
    return picks.sort().values


@register_compressor
class RandomK(Compressor):
    """Random-k sparsification: every rank sends the same ``k`` uniformly drawn coordinates (:func:`draw_subsets`),
    so only values are all-reduced. Unscaled: error feedback keeps the rest.

    Example:
        >>> import torch
        >>> from lightning_sparse.compressors import CompressContext
        >>> mine, theirs = CompressContext(step=3, key=7, rank=0), CompressContext(step=3, key=7, rank=1)
        >>> torch.equal(RandomK().select(torch.randn(100), 5, mine), RandomK().select(torch.randn(100), 5, theirs))
        True
    """

    name = "randomk"
    pattern = "shared"
    at_once = "randomk"

    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        """The coordinates sent for this tensor (ascending), a function of the context and sizes only."""
        d = p.numel()
        if k >= d:
            return torch.arange(d, device=p.device)
        return draw_subsets(_one_tensor(ctx.key & _M32, d, k, p.device), ctx.seed, ctx.step)


@functools.lru_cache(maxsize=256)
def _one_tensor(key: int, d: int, k: int, device: torch.device) -> SubsetLayout:
    return SubsetLayout.of(((key, 0, d, k),), device)
