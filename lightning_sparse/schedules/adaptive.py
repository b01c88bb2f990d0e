"""AdaptiveDensity: every step, the density that maximises the objective improvement per
communicated bit (Khirirat, Magnusson, Aytekin and Johansson), the same on every rank."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse._utils import bad_argument, check_density, check_int, scratch
from lightning_sparse.compressors import TopK
from lightning_sparse.schedules.base import DensitySchedule, k_for
from lightning_sparse.wire import Collectives, WireContext, bucket_wire_bytes, sparse_pays
from lightning_sparse.wire.comm import Issued, wait
from lightning_sparse.wire.cost import ring_all_gather_bytes, ring_all_reduce_bytes

if TYPE_CHECKING:
    pass


_EXACT_NUMEL = 1 << 16  # tensors up to this size get their exact top-k energy curve (one sort)
_BINS_PER_OCTAVE = 16  # larger ones: a histogram of p^2 in bins 2**(1/16) wide, over ...
_OCTAVES = 64  # ... the 64 octaves below max(p^2) (everything smaller shares the lowest bin)
_SHORTLIST = 4096  # and the exact curve of (about) the largest 4096 entries
_W1_ALPHA, _W1_BETA = 1e-5, 1e-9  # placeholders on one process, where nothing crosses a network
_MEASURE_BYTES = (8, 1 << 14, 1 << 17, 1 << 20)  # message sizes timed to fit alpha + beta * bytes
_MEASURE_REPEATS = 7


def topk_energy(p: Tensor, ks: Sequence[int]) -> Tensor:
    """``||Top_k(p)||^2`` for each ``k`` in ``ks``, and ``||p||^2`` last (float64, on p's device).

    Tensors of up to 65,536 elements get exact values (one sort). Larger ones get a histogram of
    ``p^2`` on a log scale (16 bins per factor 2, a few passes, no sort): the entries at or above
    a bin edge are exactly the top-c entries (c their count), so every bin edge is an exact point
    (c, top-c energy) of the curve, and the value at each requested ``k`` is interpolated
    linearly between the two points around it. Inside one bin the values differ by less than
    4.4%, so the interpolation errs by less than that (low: the curve is concave), in practice
    by far less; the largest few thousand entries (whole bins) are sorted, so the curve is exact
    for k up to there. Deterministic. Non-finite entries give non-finite values.

    Example:
        >>> import torch
        >>> topk_energy(torch.tensor([3.0, -1.0, 2.0]), [1, 2]).tolist()
        [9.0, 13.0, 14.0]
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
    total = a2.sum().double().reshape(1)  # float32 (pairwise) sum: a float64 sum costs 10x more
    nb = _BINS_PER_OCTAVE * _OCTAVES
    # bin = floor(S * (log2(a2) - log2(max a2)) + nb), clamped to [0, nb - 1]: monotone in a2
    v = torch.log2(a2, out=scratch("energy.bin", d, torch.float32, dev))
    v.mul_(_BINS_PER_OCTAVE).add_(nb - _BINS_PER_OCTAVE * torch.log2(a2.max()))
    torch.nan_to_num_(v, nan=0.0, posinf=nb - 1, neginf=0.0).clamp_(0, nb - 1)
    bins = v.to(torch.int32)
    counts = torch.bincount(bins, minlength=nb).to(torch.float64)
    energy = torch.bincount(bins, weights=a2, minlength=nb).to(torch.float64)
    # entries in bins >= j: the top-c entries; points from the highest bin edge down to all of p
    above_c = counts.flip(0).cumsum(0)
    above_e = energy.flip(0).cumsum(0)
    zero = torch.zeros(1, dtype=torch.float64, device=dev)
    xs = torch.cat([zero, above_c])
    ys = torch.cat([zero, above_e])
    curve = _interp(kt.to(torch.float64), xs, ys)
    # The top bins hold few entries each, so interpolation is coarsest at small k: sort the
    # largest few thousand entries (whole bins) and take their exact curve wherever it reaches.
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


class AdaptiveDensity(DensitySchedule):
    """Every step, the density whose top-k improves the objective most per communicated bit.

    The rule of Khirirat, Magnusson, Aytekin and Johansson (communication-aware adaptive
    tuning): with ``p`` the gradient plus residual, the step's objective improvement grows with
    ``||Top_k(p)||^2`` and its cost is ``C(k)``, so send ``k* = argmax_k ||Top_k(p)||^2 / C(k)``.

    Cost models, per message (one message per bucket):

    - ``"bits"``: ``C = c0 + c1 * k``. ``c0`` is the per-message overhead in bits and must be
      > 0: without it the ratio is largest at ``k = 1`` (the first coordinate always carries the
      most energy per bit). ``c1`` is the bits per sent coordinate; None takes the bits this rank
      actually hands to the collectives for the message: value bits plus 32 index bits per
      coordinate for all-gather compressors (top-k), value bits for shared-coordinate ones
      (random-k), the tables and candidate values for count-sketch.
    - ``"latency_bandwidth"``: ``C = alpha + beta * bytes`` with ``bytes`` what the collective
      moves through each rank (ring model), in seconds. ``alpha`` / ``beta`` left None are
      measured at start-up by timing the process group's own collectives (the compressor's
      all-gather or all-reduce at a few sizes, the slowest rank's median per size, fitted by least
      squares), so every rank holds the same numbers; they are saved with the schedule's state.

    A bucket that the strategy would send dense at a candidate density (``fallback_to_dense``:
    the sparse exchange would move at least the bytes of a dense all-reduce) is costed as dense,
    with all of its energy. The rule is made for top-k-like compressors; with random-k (shared
    coordinates) the expected energy sent is ``k/d * ||p||^2``, whose ratio to any cost with
    ``c0 > 0`` only grows with k, so it settles at ``max_density`` (or dense).

    Every rank chooses the same density: each estimates its energy curve
    ``||Top_k(p)||^2`` at the candidate densities (exact for tensors up to 65,536 elements, from a
    log-scale histogram of ``p^2`` for larger ones; see :func:`topk_energy`), the ranks
    all-gather those few numbers once per step (one small collective, launched at the end of the
    step) and each sums them in rank order - identical inputs, identical choice. The choice from
    step ``t``'s statistics is used at step ``t + 1``: every bucket of a step must use the density
    fixed before its first bucket is compressed, while the statistics are only complete after its
    last. Before the first statistics arrive, ``initial_density`` is used.

    Args:
        cost_model: ``"bits"`` or ``"latency_bandwidth"``.
        min_density: smallest candidate density, in (0, 1].
        max_density: largest candidate density, in [min_density, 1].
        candidates: number of candidate densities, log-spaced from min_density to max_density.
        c0: bits model: per-message overhead in bits (required, > 0).
        c1: bits model: bits per sent coordinate (> 0), or None for the bits of the actual message.
        alpha: latency-bandwidth model: seconds per message (> 0), or None to measure it.
        beta: latency-bandwidth model: seconds per byte (> 0), or None to measure it.
        initial_density: density before the first statistics (in (0, 1]).
        interval: gather statistics every ``interval`` steps (>= 1) and keep the density in between;
            each statistics step costs a few passes over every sparse tensor and one small collective.

    Example:
        >>> s = AdaptiveDensity(cost_model="bits", c0=100_000, min_density=0.001, max_density=0.1)
        >>> s.density(step=0)  # before any statistics
        0.01
        >>> AdaptiveDensity(cost_model="bits", c0=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: c0=0 is not allowed: expected a per-message overhead in bits > 0 ...
    """

    observes = True

    def __init__(
        self,
        cost_model: Literal["bits", "latency_bandwidth"] = "latency_bandwidth",
        min_density: float = 0.0001,
        max_density: float = 0.25,
        candidates: int = 20,
        c0: float | None = None,
        c1: float | None = None,
        alpha: float | None = None,
        beta: float | None = None,
        initial_density: float = 0.01,
        interval: int = 1,
    ) -> None:
        if cost_model not in ("bits", "latency_bandwidth"):
            raise bad_argument("cost_model", cost_model, "expected 'bits' or 'latency_bandwidth'")
        self.cost_model = cost_model
        self.min_density = check_density("min_density", min_density)
        self.max_density = check_density("max_density", max_density)
        if self.max_density < self.min_density:
            raise bad_argument("max_density", max_density, f"expected a number in [min_density={min_density}, 1]")
        self.candidates = check_int("candidates", candidates, minimum=1)
        if self.candidates == 1 and self.max_density != self.min_density:
            raise bad_argument("candidates", candidates, "expected an integer >= 2 when min_density < max_density")
        self.c0 = _check_positive("c0", c0)
        self.c1 = _check_positive("c1", c1)
        self.alpha = _check_positive("alpha", alpha)
        self.beta = _check_positive("beta", beta)
        if cost_model == "bits":
            if c0 is None or c0 <= 0:
                raise bad_argument(
                    "c0",
                    c0,
                    "expected a per-message overhead in bits > 0 with cost_model='bits' (with c0 = 0 the rule "
                    "argmax ||Top_k(p)||^2 / (c1*k) degenerates to k = 1)",
                )
            for name, value in (("alpha", alpha), ("beta", beta)):
                if value is not None:
                    raise bad_argument(name, value, "expected None with cost_model='bits' (it has c0 and c1)")
        else:
            for name, value in (("c0", c0), ("c1", c1)):
                if value is not None:
                    raise bad_argument(
                        name, value, "expected None with cost_model='latency_bandwidth' (it has alpha and beta)"
                    )
        self.initial_density = check_density("initial_density", initial_density)
        self.interval = check_int("interval", interval, minimum=1)
        g = self.candidates
        ratio = self.max_density / self.min_density
        self.grid: tuple[float, ...] = tuple(
            self.min_density * ratio ** (j / (g - 1)) if g > 1 else self.min_density for j in range(g)
        )

        # state (saved)
        self._density = self.initial_density
        self._decided_step: int | None = None
        self._measured: dict[str, float] | None = None
        # set up by setup() (not saved, not pickled)
        self._wire: dict[str, Any] = {}
        # what a message costs is asked of the wire under these settings (before setup: one
        # process, an int32 all-gather)
        self._ctx = WireContext(compressor=TopK(), exchange="allgather", compact_indices=False)
        self._comm = Collectives()
        self._rows: dict[str, Tensor] = {}
        self._sizes: dict[str, list[int]] = {}
        self._pending: tuple[int, list[tuple[str, tuple[int, ...]]], Tensor, Issued | None] | None = None
        self._ks: dict[int, list[int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        self._resolve()
        state = self.__dict__.copy()
        state.update(_comm=Collectives(), _rows={}, _sizes={}, _pending=None)
        state["_ctx"] = dataclasses.replace(self._ctx, comm=Collectives())
        return state

    @property
    def _group(self) -> dist.ProcessGroup | None:
        """The process group the statistics are gathered over (None until set up, and once pickled)."""
        return self._comm.group

    # ------------------------------------------------------------------ public API
    def density(self, step: int) -> float:
        self._resolve()
        return self._density

    def config(self) -> dict[str, Any]:
        return {
            "cost_model": self.cost_model,
            "min_density": self.min_density,
            "max_density": self.max_density,
            "candidates": self.candidates,
            "c0": self.c0,
            "c1": self.c1,
            "alpha": self.alpha,
            "beta": self.beta,
            "initial_density": self.initial_density,
            "interval": self.interval,
        }

    def state_dict(self) -> dict[str, Any]:
        self._resolve()
        return {
            "density": self._density,
            "decided_step": self._decided_step,
            "measured": dict(self._measured) if self._measured is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resolve()
        self._density = float(state["density"])
        self._decided_step = None if state["decided_step"] is None else int(state["decided_step"])
        measured = state.get("measured")
        self._measured = dict(measured) if measured is not None else None
        self._rows, self._sizes = {}, {}

    @property
    def cost_parameters(self) -> dict[str, float | None]:
        """The cost model's numbers in use: ``c0``/``c1`` (bits; c1 None: the message's own bits)
        or ``alpha``/``beta`` (seconds; measured ones once measured)."""
        if self.cost_model == "bits":
            return {"c0": self.c0, "c1": self.c1}
        alpha, beta = self._alpha_beta()
        return {"alpha": alpha, "beta": beta}

    # ------------------------------------------------------------------ hook API
    def setup(self, ctx: WireContext, device: torch.device, grad_dtype: torch.dtype) -> None:
        world = ctx.world_size
        vdtype = ctx.value_dtype or grad_dtype
        self._wire = {
            "world": world,
            "rank": ctx.rank,
            "seed": ctx.seed,
            "pattern": ctx.compressor.pattern,
            "exchange": ctx.exchange,
            "compact": ctx.compact_indices,
            "fallback": ctx.byte_rule,
            "vbytes": vdtype.itemsize,
            "gbytes": grad_dtype.itemsize,
        }
        self._ctx = ctx
        self._comm = ctx.comm
        self._rows, self._sizes, self._pending = {}, {}, None
        needs_measure = self.cost_model == "latency_bandwidth" and (self.alpha is None or self.beta is None)
        if needs_measure and world > 1:
            if self._measured is None or self._measured.get("world_size") != world:
                self._measured = self._measure(device)

    def observe(self, step: int, bucket: str, name: str, p: Tensor) -> None:
        if step % self.interval:
            return
        d = p.numel()
        ks = self._ks.get(d)
        if ks is None:
            ks = self._ks[d] = [k_for(d, x) for x in self.grid]
        e = topk_energy(p, ks)
        row = self._rows.get(bucket)
        if row is None:
            self._rows[bucket] = e
            self._sizes[bucket] = [d]
        else:
            row.add_(e)
            self._sizes[bucket].append(d)

    def end_step(self, step: int) -> int:
        self._resolve()
        if not self._rows:
            return 0
        labels = sorted(self._rows)  # the same layout on every rank, whatever order buckets came in
        # float32 on the wire (half the bytes; the choice needs nowhere near float64's precision)
        local = torch.stack([self._rows[b] for b in labels]).reshape(-1).float()
        layout = [(b, tuple(self._sizes[b])) for b in labels]
        self._rows, self._sizes = {}, {}
        world = int(self._wire.get("world", 1))
        future = None
        if world > 1:
            gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
            future = self._comm.all_gather(gathered, local)
        else:
            gathered = local
        self._pending = (step, layout, gathered, future)
        return local.numel() * local.element_size() if future is not None else 0

    # ------------------------------------------------------------------ decision
    def _resolve(self) -> None:
        """Fold the last step's gathered statistics into the decision (waits, never launches)."""
        if self._pending is None:
            return
        step, layout, gathered, future = self._pending
        self._pending = None
        if future is not None:
            wait(future)
        g = len(self.grid) + 1
        world = gathered.numel() // (len(layout) * g)
        per_rank = gathered.reshape(world, len(layout), g).cpu().tolist()
        energy = [[0.0] * g for _ in layout]
        for rank_rows in per_rank:  # summed in rank order: identical bits on every rank
            for b, row in enumerate(rank_rows):
                for j in range(g):
                    energy[b][j] += row[j]
        self._density = self.choose(layout, energy)
        self._decided_step = step + 1

    def choose(self, layout: Sequence[tuple[str, Sequence[int]]], energy: Sequence[Sequence[float]]) -> float:
        """The candidate density with the largest energy per cost (ties: the smallest density).

        ``layout`` lists the buckets (label, sparse tensor sizes); ``energy[b]`` holds bucket b's
        ``||Top_k(p)||^2`` at each candidate density and its ``||p||^2`` last, summed over ranks.
        """
        if sum(row[-1] for row in energy) <= 0.0:
            return self._density  # nothing to learn from an all-zero gradient
        shared = self._wire.get("pattern") == "shared"
        best, best_ratio = self._density, -math.inf
        for j, density in enumerate(self.grid):
            gain = cost = 0.0
            for (_, sizes), row in zip(layout, energy, strict=True):
                ks = [k_for(d, density) for d in sizes]
                sparse_cost, dense_cost = self.message_costs(ks, sizes)
                if dense_cost is not None:  # the strategy would send this bucket dense
                    gain += row[-1]
                    cost += dense_cost
                else:
                    # random-k (shared coordinates) sends a uniform k-subset: expected energy k/d * ||p||^2
                    gain += row[-1] * sum(ks) / sum(sizes) if shared else row[j]
                    cost += sparse_cost
            ratio = gain / cost
            if ratio > best_ratio:
                best, best_ratio = density, ratio
        return best

    def message_costs(self, ks: Sequence[int], sizes: Sequence[int]) -> tuple[float, float | None]:
        """Cost of a bucket's sparse message sending ``ks`` of tensors of ``sizes``, and the cost of
        its dense all-reduce if the strategy would fall back to one (else None), in the model's unit."""
        w = self._wire
        world = int(w.get("world", 1))
        vbytes, gbytes = int(w.get("vbytes", 4)), int(w.get("gbytes", 4))
        ks, sizes = list(ks), list(sizes)
        wire = bucket_wire_bytes(self._ctx, ks, sizes, vbytes)
        dense_wire = ring_all_reduce_bytes(world, sum(sizes) * gbytes)
        if self.cost_model == "bits":
            assert self.c0 is not None
            # c1 None: the bits this rank hands to the collectives (a 2-rank ring moves each byte once)
            payload = (
                self.c1 * sum(ks)
                if self.c1 is not None
                else 8 * bucket_wire_bytes(self._ctx, ks, sizes, vbytes, world=2)
            )
            sparse, dense = self.c0 + payload, self.c0 + 8 * gbytes * sum(sizes)
        else:
            alpha, beta = self._alpha_beta()
            sparse, dense = alpha + beta * wire, alpha + beta * dense_wire
        falls_back = w.get("fallback", True) and not sparse_pays(wire, world, sum(sizes) * gbytes)
        return sparse, dense if falls_back else None

    def _alpha_beta(self) -> tuple[float, float]:
        m = self._measured or {}
        alpha = self.alpha if self.alpha is not None else m.get("alpha", _W1_ALPHA)
        beta = self.beta if self.beta is not None else m.get("beta", _W1_BETA)
        return float(alpha), float(beta)

    # ------------------------------------------------------------------ measurement
    def _measure(self, device: torch.device) -> dict[str, float]:
        """Fit ``seconds = alpha + beta * wire bytes`` to this process group's own collectives."""
        world = int(self._wire["world"])
        gather = self._wire["pattern"] == "gather"
        comm = self._comm
        medians = []
        xs = []
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
        ts = t.cpu().tolist()
        alpha, beta = _fit_line(xs, ts)
        return {"alpha": alpha, "beta": beta, "world_size": world}


def _fit_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = alpha + beta * x``, with alpha and beta kept positive."""
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


def _check_positive(name: str, value: Any) -> float | None:
    """None, or a finite number > 0 (``c0 = 0`` passes here: the bits model explains why it fails)."""
    if value is None:
        return None
    allowed = "expected None or a finite number > 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_argument(name, value, allowed)
    if value < 0 or (value == 0 and name != "c0"):
        raise bad_argument(name, value, allowed)
    return float(value)
