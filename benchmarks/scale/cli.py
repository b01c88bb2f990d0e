"""The command: the model's rows at both sizes, the measured runs checked against them, the targets,
and the table, JSON and plot."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.scale.measure import check_measured, launch, measured_row, worker
from benchmarks.scale.model import (
    COLUMNS,
    CONFIGS,
    MODEL_WORLD_SIZES,
    ddp_buckets,
    describe_size,
    mlp_tensors,
    model_row,
)
from benchmarks.scale.options import check_arguments, parse_count
from benchmarks.scale.plots import plot
from benchmarks.scale.report import format_table, targets


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args)
    check_arguments(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise RuntimeError('--plot needs matplotlib: pip install "lightning_sparse[plot]"') from err
    start = time.perf_counter()
    cap = int(args.bucket_mb * 1024 * 1024)
    world_sizes = list(dict.fromkeys(args.world_sizes))
    all_worlds = sorted(set(MODEL_WORLD_SIZES) | set(world_sizes))
    result: dict[str, Any] = {
        "density": args.density,
        "layers": args.layers,
        "bucket_mb": args.bucket_mb,
        "torch": torch.__version__,
        "configs": {c: CONFIGS.get(c, {}) for c in COLUMNS},
    }
    for key, params in (("model", args.params), ("measure_model", args.measure_params)):
        count = parse_count("--params" if key == "model" else "--measure-params", params)
        buckets = ddp_buckets(mlp_tensors(count, args.layers), cap)
        result[key] = {
            "size": describe_size(count, args.layers, cap, args.density),
            "rows": [model_row(buckets, args.density, w) for w in all_worlds],
        }
    model_at = {r["world"]: r for r in result["measure_model"]["rows"]}
    result["measured"] = []
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for world in world_sizes:
            began = time.perf_counter()
            print(f"scale: measuring on {world} processes ...", file=sys.stderr, flush=True)
            row = measured_row(launch(args, world, Path(tmp)), world)
            row["seconds"] = time.perf_counter() - began
            worst = max(worst, check_measured(row, model_at[world]))
            result["measured"].append(row)
    result["measured_vs_model_max_rel"] = worst
    result["targets"] = targets(result)
    result["seconds"] = time.perf_counter() - start
    print(format_table(result))
    took = ", ".join(f"{r['seconds']:.0f} s" for r in result["measured"])
    print(
        f"\nmeasured == model at W = {', '.join(map(str, world_sizes))} (largest relative difference {worst:.1e}); "
        f"measuring took {took}; "
        f"{result['seconds']:.0f} s in all"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)
    return 0 if all(t["passed"] for t in result["targets"]) else 1
