"""Compressor speed: each compressor's median time against one memory pass over the same tensor.

    python -m benchmarks compressors
    python -m benchmarks compressors --numel 25000000 --density 0.01 --compressors topk dgc

For every tensor size and density it times, round-robin in the same run (so a busy machine slows
every row alike): the baseline memory pass ``x.abs().max()``; ``torch.topk`` of ``|x|``; and each
compressor's selection of ``k = round(density * numel)`` coordinates followed by the gather of
their values (for count-sketch: sketch, candidates and the final top-k, the work every rank
does around its two all-reduces). It prints the median time and its ratio to the memory pass.

``--feedback-steps N`` times the compressors on ``p = g + e`` as error feedback leaves it after
``N`` steps of top-k (fresh normal gradients, the unsent part kept each step) instead of on a
fresh normal tensor: the residual piles up just below the selection threshold, a distribution
far from normal that threshold estimators must cope with in training (it settles after about
``1 / density`` steps).

A compressor is given by name, with constructor arguments after a colon:
``countsketch:p1=0`` (no local pre-truncation), ``rtopk:r_factor=2``.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from benchmarks._json import write_json
from lightning_sparse.compressors import COMPRESSORS, CompressContext, Compressor, exact_topk_indices

DEFAULT_COMPRESSORS = [
    "topk",
    "chunk_topk",
    "randomk",
    "rtopk",
    "gaussiank",
    "dgc",
    "randomblock",
    "countsketch",
    "countsketch:p1=0",
]
BASELINE = "memory pass"
TORCH_TOPK = "torch.topk"


def parse_compressor(spec: str) -> Compressor:
    """``"name"`` or ``"name:arg=value,arg=value"`` -> a compressor instance (ValueError if unknown)."""
    name, _, args = spec.partition(":")
    cls = COMPRESSORS.get(name.strip().lower())
    if cls is None:
        raise ValueError(f"compressor {spec!r} is not allowed: expected one of {sorted(COMPRESSORS)}")
    kwargs: dict[str, Any] = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"compressor argument {item!r} in {spec!r} is not allowed: expected name=value")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value.strip()
    return cls(**kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=int, nargs="+", default=[1_000_000, 25_000_000], help="tensor sizes")
    parser.add_argument("--density", type=float, nargs="+", default=[0.01, 0.001], help="fractions sent")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument(
        "--compressors",
        nargs="+",
        default=DEFAULT_COMPRESSORS,
        help="names, optionally with arguments: countsketch:p1=0 (default: %(default)s)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--feedback-steps",
        type=int,
        default=0,
        help="time on gradient + residual after this many steps of top-k error feedback (0: a fresh normal tensor)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    return timed


def feedback_tensor(numel: int, k: int, steps: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """``g + e`` after ``steps`` steps of top-``k`` error feedback on fresh normal gradients ``g``."""
    e = torch.zeros(numel, device=device)
    sampler = torch.Generator(device=device).manual_seed(int(gen.initial_seed()) + 1)  # top-k's own draws
    for _ in range(steps):
        e.add_(torch.randn(numel, generator=gen, device=device))
        e.index_fill_(0, exact_topk_indices(e, k, sampler), 0.0)  # what was sent leaves the residual
    return e.add_(torch.randn(numel, generator=gen, device=device))


def measure(
    numel: int,
    density: float,
    compressors: dict[str, Compressor],
    repeats: int,
    device: torch.device,
    seed: int = 0,
    feedback_steps: int = 0,
) -> list[dict[str, Any]]:
    """Median seconds per row (baseline, torch.topk, compressors) for one tensor size and density."""
    gen = torch.Generator(device=device).manual_seed(seed)
    k = max(1, min(numel, round(density * numel)))
    x = feedback_tensor(numel, k, feedback_steps, gen, device)
    step = [0]

    def ctx() -> CompressContext:
        return CompressContext(step=step[0], key=12345, rank=0, world_size=1, seed=seed)

    rows: dict[str, Callable[[], Any]] = {
        BASELINE: lambda: x.abs().max(),  # allocates |x| afresh, as a plain one-pass op does
        TORCH_TOPK: lambda: torch.topk(x.abs(), k, sorted=False),
    }
    for label, comp in compressors.items():

        def selected(comp: Compressor = comp) -> Tensor:
            return x[comp.select(x, k, ctx())]

        rows[label] = selected
    timed = _timer(device)
    times: dict[str, list[float]] = {label: [] for label in rows}
    for rep in range(repeats + 1):
        step[0] = rep
        for label, fn in rows.items():
            t = timed(fn)
            if rep:  # round 0 warms caches and scratch buffers up
                times[label].append(t)
    base = statistics.median(times[BASELINE])
    return [
        {
            "numel": numel,
            "density": density,
            "k": k,
            "name": label,
            "median_s": statistics.median(ts),
            "ratio": statistics.median(ts) / base,
            "feedback_steps": feedback_steps,
        }
        for label, ts in times.items()
    ]


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} is not allowed: expected an integer >= 1")
    if args.feedback_steps < 0:
        raise ValueError(f"--feedback-steps={args.feedback_steps} is not allowed: expected an integer >= 0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    compressors = {spec: parse_compressor(spec) for spec in args.compressors}
    print(
        f"compressors: median of {args.repeats} rounds; ratio = time / one memory pass (x.abs().max()) over the "
        f"same tensor, measured in the same rounds. device {device}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; input: "
        + (
            f"gradient + residual after {args.feedback_steps} steps of top-k error feedback"
            if args.feedback_steps
            else "a fresh normal tensor"
        )
    )
    header = f"{'numel':>12} {'density':>8} {'k':>9}  {'compressor':<20} {'median ms':>10} {'x memory pass':>14}"
    print(header)
    print("-" * len(header))
    results: list[dict[str, Any]] = []
    for numel in args.numel:
        for density in args.density:
            rows = measure(numel, density, compressors, args.repeats, device, args.seed, args.feedback_steps)
            for r in rows:
                print(
                    f"{r['numel']:>12,} {r['density']:>8g} {r['k']:>9,}  {r['name']:<20} "
                    f"{1e3 * r['median_s']:>10.2f} {r['ratio']:>14.2f}"
                )
            print()
            results.extend(rows)
    if args.json:
        payload = {
            "device": str(device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "repeats": args.repeats,
            "feedback_steps": args.feedback_steps,
            "rows": results,
        }
        write_json(args.json, payload)
    return 0
