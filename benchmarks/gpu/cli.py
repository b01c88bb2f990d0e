"""The command: runs each row's processes in turn, then reports the slower process's step and the profile."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._json import write_json
from benchmarks._ranks import free_port, run_ranks
from benchmarks.gpu.options import MODELS, RUNS, add_variants
from benchmarks.gpu.worker import worker
from benchmarks.step.launcher import failure_reason

#: variables of a launcher around this command that would tell the ranks who they are
_INHERITED = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _check(args: argparse.Namespace) -> None:
    for name in ("world_size", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is not allowed: expected >= 1")
    for name in ("warmup", "profile_steps"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is not allowed: expected >= 0")
    if args.accelerator == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--accelerator cuda: no CUDA device here; --accelerator cpu runs on the CPUs")


def _launch(
    args: argparse.Namespace, names: list[str], out: Path
) -> tuple[dict[str, list[dict[str, Any]]] | None, str | None]:
    """Run the rows ``names`` in one set of processes; returns each row's figures by rank (None on a
    failure, with its reason).

    The timed steps of every row run first, in processes that never ran the profiler; the profile
    comes from a second set of processes. A process that has run ``torch.profiler`` with CUDA
    activities keeps its CUPTI callbacks, and every kernel it launches afterwards costs more host
    time: measured in the same processes, each row after the first profiled one was timed slower
    on rank 0 than the floor (the first row) for that reason alone."""
    timed, why = _launch_pass(args, names, out / "timed", steps=args.steps, profile_steps=0)
    if timed is None or args.profile_steps == 0:
        return timed, why
    profiled, why = _launch_pass(args, names, out / "profiled", steps=1, profile_steps=args.profile_steps)
    if profiled is None:
        return None, why
    for name in names:
        for rank, figures in zip(timed[name], profiled[name], strict=True):
            rank["profile"] = figures["profile"]
    return timed, None


def _launch_pass(
    args: argparse.Namespace, names: list[str], out: Path, steps: int, profile_steps: int
) -> tuple[dict[str, list[dict[str, Any]]] | None, str | None]:
    """One set of processes running the rows ``names``: ``steps`` timed and ``profile_steps``
    profiled steps each."""
    base = [sys.executable, "-m", "benchmarks", "gpu", "--worker", "--runs", *names, "--port", str(free_port()),
            "--variants", *args.variants]  # fmt: skip
    forwarded = [
        "--accelerator", args.accelerator, "--model", args.model, "--world-size", str(args.world_size),
        "--steps", str(steps), "--warmup", str(args.warmup), "--profile-steps", str(profile_steps),
        "--timeout", str(args.timeout), "--out", str(out),
    ]  # fmt: skip
    for option, value in (
        ("--batch-size", args.batch_size),
        ("--precision", args.precision),
        ("--threads", args.threads),
        ("--trace", None if args.trace is None else str(Path(args.trace).resolve())),
    ):
        if value is not None:
            forwarded += [option, str(value)]
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env["PYTHONUNBUFFERED"] = "1"
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / f"rank{r}.log" for r in range(args.world_size)]
    cmds = [[*base, "--rank", str(r), *forwarded] for r in range(args.world_size)]
    codes, timed_out = run_ranks(cmds, env, logs, args.timeout * len(names))
    outputs = [p.read_text(errors="replace") for p in logs]
    if timed_out or any(codes):
        for r, text in enumerate(outputs):
            sys.stderr.write(f"--- {', '.join(names)}: rank {r} ---\n{text[-3000:]}")
        why = f"timed out after {args.timeout * len(names):g} s" if timed_out else failure_reason(outputs, codes)
        return None, why
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.world_size)]
    return {name: [r[name] for r in ranks] for name in names}, None


def summarise(name: str, ranks: list[dict[str, Any]], floor_s: float | None) -> dict[str, Any]:
    """One row: the slower process's mean and median step, the ratio to the floor, the collectives
    and rank 0's profile."""
    slower = max(ranks, key=lambda r: r["mean_s"])
    first = ranks[0]
    steps = len(first["times_s"])
    profile = first["profile"]
    per_exchange = first["collectives"] / first["exchanges"] if first["exchanges"] else None
    return {
        "name": name,
        "label": RUNS[name].label,
        "status": "ok",
        "settings": RUNS[name].settings,
        "mean_s": slower["mean_s"],
        "median_s": slower["median_s"],
        "slower_rank": slower["rank"],
        "ratio_to_floor": slower["mean_s"] / floor_s if floor_s else None,
        "means_s": [r["mean_s"] for r in ranks],
        "collectives": first["collectives"],
        "collectives_per_step": first["collectives"] / steps,
        "exchanges": first["exchanges"],
        "collectives_per_exchange": per_exchange,
        "host_syncs_per_step": None if profile is None else profile["host_syncs"],
        "scalar_reads_per_step": None if profile is None else profile["scalar_reads"],
        "kernel_launches_per_step": None if profile is None else profile["kernel_launches"],
        "profiled_collectives_per_step": None if profile is None else profile["collectives"],
        "profile": profile,
        "times_s": [r["times_s"] for r in ranks],
    }


def format_table(result: dict[str, Any]) -> str:
    """The rows as a text table."""
    head = (
        f"{result['model']} ({result['params']:,} parameters in {result['tensors']} tensors), "
        f"{result['world_size']} processes on {result['device']}, {result['precision']}, "
        f"batch {result['batch']} x {result['context']}"
    )
    lines = [head, f"{'run':<70} {'mean s':>8} {'median s':>9} {'x floor':>8} {'syncs':>7} {'reads':>7} "
             f"{'launches':>9} {'coll/step':>9} {'coll/ex':>8}"]  # fmt: skip

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for row in result["runs"]:
        if row["status"] != "ok":
            lines.append(f"{row['label']:<70} {row['status']}")
            continue
        lines.append(
            f"{row['label']:<70} {row['mean_s']:>8.4f} {row['median_s']:>9.4f} {num(row['ratio_to_floor'], '.2f'):>8} "
            f"{num(row['host_syncs_per_step'], '.1f'):>7} {num(row['scalar_reads_per_step'], '.1f'):>7} "
            f"{num(row['kernel_launches_per_step'], '.0f'):>9} "
            f"{num(row['profiled_collectives_per_step'], '.2f'):>9} {num(row['collectives_per_exchange'], '.1f'):>8}"
        )
    lines.append(
        "per step: host synchronisations (cuda*Synchronize), scalar reads (aten::_local_scalar_dense) and kernel "
        f"launches, collectives (c10d operators) from a profile of {result['profile_steps']} steps on rank 0; "
        "coll/ex: the package's collectives per exchange over the timed steps"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    add_variants(args.variants, args.runs)
    if args.worker:
        return worker(args)
    _check(args)
    started = time.perf_counter()
    names = list(dict.fromkeys(args.runs))
    if "floor" in names:  # first: the other rows' ratios are to it
        names.remove("floor")
        names.insert(0, "floor")
    with tempfile.TemporaryDirectory() as tmp:
        print(f"gpu: {', '.join(names)} ...", file=sys.stderr)
        found, why = _launch(args, names, Path(tmp) / "all")
        failed: dict[str, str] = {}
        if found is None:
            # one row's failure took the others down: each row once more, in processes of its own
            print(f"gpu: the run failed ({why}); each row once more on its own.", file=sys.stderr)
            found = {}
            for name in names:
                alone, why = _launch(args, [name], Path(tmp) / name)
                if alone is None:
                    failed[name] = why or "failed"
                else:
                    found.update(alone)
    rows: list[dict[str, Any]] = []
    floor_s = max(r["mean_s"] for r in found["floor"]) if "floor" in found else None  # its slower process
    for name in names:
        if name in failed:
            rows.append({"name": name, "label": RUNS[name].label, "status": f"failed: {failed[name]}"})
        else:
            rows.append(summarise(name, found[name], floor_s))
    info: dict[str, Any] = {}
    if found:
        first = next(iter(found.values()))[0]
        info = {k: first[k] for k in ("device", "precision", "tensors", "params", "batch", "context")}
    if not info:
        raise RuntimeError("every run failed: " + "; ".join(f"{r['name']}: {r['status']}" for r in rows))
    import torch

    result = {
        "model": args.model,
        "shape": MODELS[args.model],
        "accelerator": args.accelerator,
        "world_size": args.world_size,
        **info,
        "steps": args.steps,
        "warmup": args.warmup,
        "profile_steps": args.profile_steps,
        "torch": torch.__version__,
        "seconds": time.perf_counter() - started,
        "runs": rows,
    }
    print(format_table(result))
    if args.json:
        write_json(args.json, result)
    return 0
