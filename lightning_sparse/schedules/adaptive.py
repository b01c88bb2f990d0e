"""AdaptiveDensity: each step's density with the most objective improvement per communicated bit."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_sparse._utils import bad_argument, check_density, check_int, check_number
from lightning_sparse.compressors import TopK
from lightning_sparse.schedules.base import DensitySchedule
from lightning_sparse.schedules.energy import topk_energy
from lightning_sparse.schedules.link import measure_link
from lightning_sparse.wire import Collectives, WireContext, bucket_wire_bytes, sparse_pays
from lightning_sparse.wire.comm import Issued, wait
from lightning_sparse.wire.stats import ring_all_reduce_bytes

_W1_ALPHA, _W1_BETA = 1e-5, 1e-9  # placeholders on one process, where nothing crosses a network


class AdaptiveDensity(DensitySchedule):
    """Every step, the density whose top-k improves the objective most per communicated bit.

    The rule of Khirirat, Magnusson, Aytekin and Johansson: with ``p`` the gradient plus residual, send
    ``k* = argmax_k ||Top_k(p)||^2 / C(k)``, with ``C`` per message: ``"bits"``: ``C = c0 + c1 * k``;
    ``"latency_bandwidth"``: ``C = alpha + beta * bytes`` (ring model, seconds; ``alpha`` / ``beta`` left None are
    measured at start-up). A bucket the strategy would send dense is costed dense. Every rank chooses the same
    density from the energy curves all-gathered once a step; step ``t``'s choice applies from step ``t + 1``.

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
        interval: gather statistics every ``interval`` steps (>= 1), keeping the density in between.

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
        self.c0, self.c1, self.alpha, self.beta = (
            _check_positive(name, value) for name, value in (("c0", c0), ("c1", c1), ("alpha", alpha), ("beta", beta))
        )
        if cost_model == "bits" and (c0 is None or c0 <= 0):
            allowed = "expected a per-message overhead in bits > 0 with cost_model='bits' (with c0 = 0 the rule "
            raise bad_argument("c0", c0, allowed + "argmax ||Top_k(p)||^2 / (c1*k) degenerates to k = 1)")
        others = {"alpha": alpha, "beta": beta} if cost_model == "bits" else {"c0": c0, "c1": c1}
        for name, value in others.items():
            if value is not None:
                own = "alpha and beta" if "c0" in others else "c0 and c1"
                raise bad_argument(name, value, f"expected None with cost_model={cost_model!r} (it has {own})")
        self.initial_density = check_density("initial_density", initial_density)
        self.interval = check_int("interval", interval, minimum=1)
        g, ratio = self.candidates, self.max_density / self.min_density
        self.grid = tuple(self.min_density * ratio ** (j / (g - 1)) if g > 1 else self.min_density for j in range(g))

        # state (saved)
        self._density = self.initial_density
        self._decided_step: int | None = None
        self._measured: dict[str, float] | None = None
        # until setup() gives the wire's settings and process group (a pickled copy keeps no group)
        self._ctx = WireContext(
            compressor=TopK(),
            error_feedback=True,
            momentum_correction=0.0,
            value_dtype=None,
            seed=0,
            exchange="allgather",
            compact_indices=False,
            value_bits=None,
            byte_rule=True,
        )
        self._grad_dtype = torch.float32
        self._rows: dict[str, Tensor] = {}
        self._sizes: dict[str, list[int]] = {}
        self._pending: tuple[int, list[tuple[str, tuple[int, ...]]], Tensor, Issued | None] | None = None
        self._ks: dict[int, list[int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        self._resolve()
        state = self.__dict__.copy()
        state.update(_rows={}, _sizes={}, _pending=None, _ctx=dataclasses.replace(self._ctx, comm=Collectives()))
        return state

    def density(self, step: int) -> float:
        self._resolve()
        return self._density

    def config(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in inspect.signature(AdaptiveDensity).parameters}

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
        """The cost model's numbers in use: ``c0``/``c1`` or ``alpha``/``beta`` (measured ones once measured)."""
        if self.cost_model == "bits":
            return {"c0": self.c0, "c1": self.c1}
        alpha, beta = self._alpha_beta()
        return {"alpha": alpha, "beta": beta}

    def setup(self, ctx: WireContext, device: torch.device, grad_dtype: torch.dtype) -> None:
        self._ctx, self._grad_dtype = ctx, grad_dtype
        self._rows, self._sizes, self._pending, self._ks = {}, {}, None, {}
        world = ctx.world_size
        measured = self._measured is not None and self._measured.get("world_size") == world
        if self.cost_model == "latency_bandwidth" and None in (self.alpha, self.beta) and world > 1 and not measured:
            self._measured = measure_link(ctx.comm, ctx.compressor.pattern, device)

    def observe(self, step: int, bucket: str, name: str, p: Tensor) -> None:
        if step % self.interval:
            return
        d = p.numel()
        ks = self._ks.get(d)
        if ks is None:
            ks = self._ks[d] = [self._ctx.compressor.k_for(d, x) for x in self.grid]
        e = topk_energy(p, ks)
        if bucket in self._rows:
            self._rows[bucket].add_(e)
        else:
            self._rows[bucket] = e
        self._sizes.setdefault(bucket, []).append(d)

    def end_step(self, step: int) -> int:
        self._resolve()
        if not self._rows:
            return 0
        labels = sorted(self._rows)  # the same layout on every rank, whatever order buckets came in
        # float32 on the wire (half the bytes; the choice needs nowhere near float64's precision)
        local = torch.stack([self._rows[b] for b in labels]).reshape(-1).float()
        layout = [(b, tuple(self._sizes[b])) for b in labels]
        self._rows, self._sizes = {}, {}
        comm = self._ctx.comm
        gathered, future = local, None
        if comm.world > 1:
            gathered = torch.empty(comm.world * local.numel(), dtype=local.dtype, device=local.device)
            future = comm.all_gather(gathered, local)
        self._pending = (step, layout, gathered, future)
        return local.numel() * local.element_size() if future is not None else 0

    def _resolve(self) -> None:
        """Fold the last step's gathered statistics into the decision (waits, never launches)."""
        if self._pending is None:
            return
        step, layout, gathered, future = self._pending
        self._pending = None
        wait(future)
        g = len(self.grid) + 1
        per_rank = gathered.reshape(-1, len(layout), g).cpu().tolist()
        energy = [[0.0] * g for _ in layout]
        for rank_rows in per_rank:  # summed in rank order: identical bits on every rank
            for total, row in zip(energy, rank_rows, strict=True):
                total[:] = [e + x for e, x in zip(total, row, strict=True)]
        self._density = self.choose(layout, energy)
        self._decided_step = step + 1

    def choose(self, layout: Sequence[tuple[str, Sequence[int]]], energy: Sequence[Sequence[float]]) -> float:
        """The candidate density with the largest energy per cost (ties: the smallest density). ``layout``: the
        buckets (label, sparse sizes); ``energy[b]``: bucket b's ``||Top_k(p)||^2`` at each candidate and ``||p||^2``
        last, summed over ranks."""
        if sum(row[-1] for row in energy) <= 0.0:
            return self._density  # nothing to learn from an all-zero gradient
        compressor = self._ctx.compressor
        shared = compressor.pattern == "shared"
        best, best_ratio = self._density, -math.inf
        for j, density in enumerate(self.grid):
            gain = cost = 0.0
            for (_, sizes), row in zip(layout, energy, strict=True):
                ks = [compressor.k_for(d, density) for d in sizes]
                sparse_cost, dense_cost = self.message_costs(ks, sizes)
                if dense_cost is not None:  # the strategy would send this bucket dense
                    gain, cost = gain + row[-1], cost + dense_cost
                else:  # random-k (shared coordinates) sends a uniform k-subset: expected energy k/d * ||p||^2
                    gain, cost = gain + (row[-1] * sum(ks) / sum(sizes) if shared else row[j]), cost + sparse_cost
            ratio = gain / cost
            if ratio > best_ratio:
                best, best_ratio = density, ratio
        return best

    def message_costs(self, ks: Sequence[int], sizes: Sequence[int]) -> tuple[float, float | None]:
        """Cost of a bucket's sparse message sending ``ks`` of tensors of ``sizes``, and of its dense all-reduce if
        the strategy would fall back to one (else None)."""
        ctx = self._ctx
        world = ctx.world_size
        vbytes, gbytes = (ctx.value_dtype or self._grad_dtype).itemsize, self._grad_dtype.itemsize
        ks, sizes = list(ks), list(sizes)
        wire = bucket_wire_bytes(ctx, ks, sizes, vbytes)
        if self.cost_model == "bits":
            assert self.c0 is not None
            # c1 None: the bits this rank hands to the collectives (a 2-rank ring moves each byte once)
            payload = (
                self.c1 * sum(ks) if self.c1 is not None else 8 * bucket_wire_bytes(ctx, ks, sizes, vbytes, world=2)
            )
            sparse, dense = self.c0 + payload, self.c0 + 8 * gbytes * sum(sizes)
        else:
            alpha, beta = self._alpha_beta()
            sparse, dense = alpha + beta * wire, alpha + beta * ring_all_reduce_bytes(world, sum(sizes) * gbytes)
        falls_back = ctx.byte_rule and not sparse_pays(wire, world, sum(sizes) * gbytes)
        return sparse, dense if falls_back else None

    def _alpha_beta(self) -> tuple[float, float]:
        m = self._measured or {}
        alpha = self.alpha if self.alpha is not None else m.get("alpha", _W1_ALPHA)
        beta = self.beta if self.beta is not None else m.get("beta", _W1_BETA)
        return float(alpha), float(beta)


def _check_positive(name: str, value: Any) -> float | None:
    """None, or a finite number > 0 (``c0 = 0`` passes here: the bits model explains why it fails)."""
    if value is None:
        return None
    allowed = "expected None or a finite number > 0"
    return check_number(name, value, allowed, lambda v: v > 0 or (v == 0 and name == "c0"))
