"""The link measurement: ``seconds = alpha + beta * bytes`` fitted to a process group's own collectives."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_sparse.wire import Collectives
from lightning_sparse.wire.comm import wait
from lightning_sparse.wire.stats import ring_all_gather_bytes, ring_all_reduce_bytes

_MEASURE_BYTES = (8, 1 << 14, 1 << 17, 1 << 20)  # message sizes timed to fit alpha + beta * bytes
_MEASURE_REPEATS = 7


def measure_link(comm: Collectives, pattern: str, device: torch.device) -> dict[str, float]:
    """Fit ``seconds = alpha + beta * wire bytes`` to the collectives of ``comm``'s process group: the collective of
    ``pattern`` (``"gather"``: an all-gather, else an all-reduce) timed at a few sizes, the slowest rank's medians
    fitted, on every rank together. Returns ``{"alpha", "beta", "world_size"}``."""
    world = comm.world
    gather = pattern == "gather"
    medians, xs = [], []
    for nbytes in _MEASURE_BYTES:
        if gather:
            msg = torch.ones(nbytes, dtype=torch.uint8, device=device)
            out = torch.empty(world * nbytes, dtype=torch.uint8, device=device)
            xs.append(ring_all_gather_bytes(world, nbytes))
        else:
            msg = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
            xs.append(ring_all_reduce_bytes(world, msg.numel() * 4))
        times = []
        for rep in range(_MEASURE_REPEATS + 1):
            _sync(device)
            start = time.perf_counter()
            wait(comm.all_gather(out, msg) if gather else comm.all_reduce(msg))
            _sync(device)
            if rep:  # the first one is a warm-up
                times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    # the slowest rank sets the pace of a collective; max is exact, so all ranks agree bit for bit
    t = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
    alpha, beta = fit_line(xs, t.cpu().tolist())
    return {"alpha": alpha, "beta": beta, "world_size": world}


def fit_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = alpha + beta * x``, with alpha and beta kept positive.

    Example:
        >>> fit_line([0.0, 1024.0], [0.5, 1.5])  # 0.5 s per message, 1 s per 1,024 bytes
        (0.5, 0.0009765625)
    """
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / sxx if sxx > 0 else 0.0
    beta = max(beta, 1e-13)
    alpha = mt - beta * mx
    if alpha <= 0:
        alpha = max(min(ts), 1e-7)
    return float(alpha), float(beta)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
