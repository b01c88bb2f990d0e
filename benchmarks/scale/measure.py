"""The measured runs: ``W`` processes exchange the model's buckets through the hook, and their telemetry
must equal the model's figures."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks._ranks import free_port, run_ranks
from benchmarks.scale.model import COLUMNS, CONFIGS, DENSE, GRAD_DTYPE, ddp_buckets, make_state, mlp_tensors
from benchmarks.scale.options import parse_count
from lightning_sparse import end_process_group
from lightning_sparse.exchange.hook import communicate

#: relative tolerance of measured == model
TOLERANCE = 1e-9


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )
    tensors = mlp_tensors(parse_count("--measure-params", args.measure_params), args.layers)
    params = {name: torch.zeros(shape, requires_grad=True) for name, shape in tensors}
    buckets = ddp_buckets(tensors, int(args.bucket_mb * 1024 * 1024))
    figures: dict[str, list[dict[str, Any]]] = {}
    for config in CONFIGS:
        state = make_state(config, args.density)
        state.bind(params.items())
        steps = []
        for step in range(state.config.warmup_steps + 1):  # the dense warm-up step(s), then one sparse step
            gen = torch.Generator().manual_seed(1000 * args.rank + step)
            futures = []
            for i, bucket in enumerate(buckets):
                buffer = torch.randn(bucket.numel, generator=gen, dtype=GRAD_DTYPE)
                members = [params[name] for name, _ in bucket.tensors]
                futures.append(communicate(state, buffer, members, is_last=i == len(buckets) - 1))
            for future in futures:
                future.wait()
            last = state.telemetry.last  # the whole step: the hook ends a step at its last bucket
            steps.append(
                {
                    "wire_bytes": last.wire_bytes,
                    "dense_wire_bytes": last.dense_wire_bytes,
                    "sent_bytes": last.sent_bytes,
                    "buckets": last.buckets,
                    "dense_buckets": last.dense_buckets,
                }
            )
        figures[config] = steps
    gathered: list[Any] = [None] * args.world
    dist.all_gather_object(gathered, figures)
    if args.rank == 0 and args.result:
        Path(args.result).write_text(json.dumps({"ranks": gathered}))
    end_process_group(exit_code=0)  # on every rank together, then out: see its docstring
    return 0


def launch(args: argparse.Namespace, world: int, tmp: Path) -> list[dict[str, Any]]:
    """Run ``world`` measuring processes; every rank's figures (killing them all past ``--timeout``)."""
    result = tmp / f"result_{world}.json"
    port = free_port()
    base = [
        sys.executable, "-m", "benchmarks", "scale", "--worker", "--world", str(world),
        "--port", str(port), "--measure-params", str(args.measure_params), "--layers", str(args.layers),
        "--density", repr(args.density), "--bucket-mb", repr(args.bucket_mb), "--timeout", repr(args.timeout),
    ]  # fmt: skip
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmds = [[*base, "--rank", str(rank)] + (["--result", str(result)] if rank == 0 else []) for rank in range(world)]
    logs = [tmp / f"w{world}_rank{rank}.log" for rank in range(world)]
    codes, timed_out = run_ranks(cmds, env, logs, args.timeout)
    if timed_out or any(codes) or not result.is_file():
        tails = "".join(
            f"\n--- rank {rank} (exit code {code}) ---\n{path.read_text(errors='replace')[-2000:]}"
            for rank, (path, code) in enumerate(zip(logs, codes, strict=True))
        )
        why = f"did not finish within --timeout={args.timeout:g} s and were killed" if timed_out else "failed"
        raise RuntimeError(f"scale: the {world} measuring processes {why} (exit codes {codes}).{tails}")
    return json.loads(result.read_text())["ranks"]


def measured_row(ranks: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """The sparse step's wire bytes per configuration (the same on every rank: checked), and the
    dense warm-up step's."""
    row: dict[str, Any] = {"world": world, "bytes": {}}
    dense_figures: set[float] = set()
    for config in CONFIGS:
        per_rank = [r[config][-1]["wire_bytes"] for r in ranks]
        if any(v != per_rank[0] for v in per_rank):
            raise RuntimeError(f"scale: the ranks report different wire bytes for {config} at W={world}: {per_rank}")
        row["bytes"][config] = per_rank[0]
        dense_figures.update(s["wire_bytes"] for r in ranks for s in r[config][:-1])
        dense_figures.update(r[config][-1]["dense_wire_bytes"] for r in ranks)
    if len(dense_figures) != 1:
        raise RuntimeError(f"scale: the dense steps at W={world} report different wire bytes: {sorted(dense_figures)}")
    row["bytes"][DENSE] = dense_figures.pop()
    row["dense_buckets"] = {config: ranks[0][config][-1]["dense_buckets"] for config in CONFIGS}
    return row


def check_measured(measured: dict[str, Any], model: dict[str, Any]) -> float:
    """Raise when a measured figure is not the model's; the largest relative difference."""
    worst = 0.0
    for column in COLUMNS:
        got, want = measured["bytes"][column], model["bytes"][column]
        rel = abs(got - want) / max(abs(want), 1.0)
        if rel > TOLERANCE:
            raise RuntimeError(
                f"scale: at W={measured['world']} the telemetry counted {got:.1f} wire bytes per rank for {column}, "
                f"the ring model {want:.1f} (relative difference {rel:.2e} > {TOLERANCE:g})"
            )
        worst = max(worst, rel)
    for config in CONFIGS:
        got, want = measured["dense_buckets"][config], model["sent_as"][config].count("dense")
        if got != want:
            raise RuntimeError(
                f"scale: at W={measured['world']} the hook sent {got} bucket(s) dense for {config}, the model {want}"
            )
    return worst
