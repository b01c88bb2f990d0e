"""The convergence benchmark's command: its arguments, and the runs they ask for."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.convergence.launcher import launch
from benchmarks.convergence.results import report
from benchmarks.convergence.runs import (
    LIBRARY_PEERS,
    _final,
    _fmt_bytes,
    _kind,
    _ok,
    library_peer,
    parse_variant,
    run_label,
)
from benchmarks.convergence.tasks import TASKS
from benchmarks.peers import PEER_HELP, Peer

DEFAULT_DENSITIES = [0.1, 0.01, 0.001]
MODES = ("gradient", "update")
DEFAULT_PEERS = ["powersgd:1", "powersgd:4"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lightning_sparse.compressors import COMPRESSORS

    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="default: %(default)s")
    parser.add_argument(
        "--compressors",
        nargs="*",
        default=list(COMPRESSORS),
        help="compressor names; none: --compressors with no value (default: %(default)s)",
    )
    parser.add_argument("--densities", type=float, nargs="+", default=DEFAULT_DENSITIES, help="default: %(default)s")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="what the strategy compresses, SparseDDPStrategy(compress=MODE) (default: %(default)s)",
    )
    parser.add_argument(
        "--exchanges",
        nargs="+",
        default=["auto"],
        choices=["auto", "allgather", "split"],
        help="how top-k-type selections are combined, SparseDDPStrategy(exchange=...); other compressors "
        "run once (default: %(default)s)",
    )
    parser.add_argument(
        "--value-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the values the sparse runs send (default: the gradient's)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[""],
        metavar="SETTINGS",
        help="local steps, outer optimizer, coded values, warm-up exchanges and a density warm-up of the sparse "
        "runs, one variant each: 'sync_every=16,outer=nesterov,value_bits=2,warmup=0,density_start=0.1,"
        "density_steps=40,delay=1,fragments=4'; 'density=0.0025' replaces the run's density; 'outer_lr=1.0' sets the "
        "Nesterov outer step's learning rate ('': none) "
        "(default: one plain variant)",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=DEFAULT_PEERS,
        metavar="PEER",
        help=f"reference rows: torch's DDP comm hooks, {PEER_HELP} (bare powersgd: rank 4); diloco:H "
        "(DiLoCo: H local steps, dense average, Nesterov outer step 0.7/0.9); torchft:H (DiLoCo of the torchft "
        "package); demo (DeMo, pytorch-optimizer's "
        "optimizer, lr 1e-3); none: --peers with no value (default: %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every run (default: the task's own)")
    parser.add_argument(
        "--limit-train-batches",
        type=int,
        default=None,
        metavar="N",
        help="train on N batches per epoch (default: the task's own; gpt: 100)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="gpt: a tiny model (width 32, 1 block, context 16) for smoke runs"
    )
    parser.add_argument("--devices", type=int, default=2, help="CPU processes per run (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data order")
    parser.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="S",
        help="shard the model with FSDP2 in groups of S processes: the dense run is dense HSDP, the sparse runs "
        "sparse_fsdp (update mode; a variant with shard=0 runs sparse_ddp) (default: no sharding)",
    )
    parser.add_argument("--no-dense", action="store_true", help="skip the dense DDP run (no reference figures)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run (default: %(default)s)")
    parser.add_argument("--out", default="convergence_out", metavar="DIR", help="output folder (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the JSON here (default: OUT/...)")
    parser.add_argument(
        "--from-json",
        default=None,
        metavar="PATH",
        help="train nothing: write the table and plots of the runs in a convergence.json this command wrote",
    )


def run(args: argparse.Namespace) -> int:
    from lightning_sparse.compressors import COMPRESSORS

    for name in args.compressors:
        if name not in COMPRESSORS:
            raise ValueError(f"--compressors {name!r} is not allowed: expected names in {sorted(COMPRESSORS)}")
    for d in args.densities:
        if not 0 < d <= 1:
            raise ValueError(f"--densities {d!r} is not allowed: expected numbers in (0, 1]")
    given = list(dict.fromkeys(getattr(args, "peers", None) or []))
    frontier = [library_peer(p) for p in given if p.split(":")[0] in LIBRARY_PEERS]
    peers = list(dict.fromkeys(Peer.parse(p).name for p in given if p.split(":")[0] not in LIBRARY_PEERS))
    variants = [parse_variant(v) for v in dict.fromkeys(getattr(args, "variants", None) or [""])]
    modes = list(dict.fromkeys(getattr(args, "modes", None) or ["gradient"]))
    for flag, value, low in (
        ("--epochs", args.epochs, 1),
        ("--devices", args.devices, 1),
        ("--limit-train-batches", args.limit_train_batches, 1),
    ):
        if value is not None and value < low:
            raise ValueError(f"{flag}={value} is not allowed: expected an integer >= {low}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        return report(saved["runs"], saved["total_seconds"], saved["args"], saved["tasks"], out, args.json)
    started = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="convergence_") as tmp:
        for task_name in args.tasks:
            task = TASKS[task_name]
            base = {
                "task": task_name,
                "epochs": args.epochs or task.epochs,
                "limit_train_batches": args.limit_train_batches or task.limit_train_batches,
                "devices": args.devices,
                "seed": args.seed,
                "tiny": bool(getattr(args, "tiny", False)),
            }
            shard = getattr(args, "shard_size", None)
            if shard is not None:
                if not task.sharded_modules and not task.self_sharded:
                    raise ValueError(
                        f"--shard-size is not allowed with --tasks {task_name}: it names no module to shard"
                    )
                if shard < 1 or args.devices % shard:
                    raise ValueError(
                        f"--shard-size={shard} is not allowed: expected a divisor of --devices={args.devices}"
                    )
                base["shard_size"] = shard
            specs: list[dict[str, Any]] = [] if args.no_dense else [{"compressor": None, "density": 1.0}]
            specs += [{"compressor": None, "density": None, "peer": p} for p in peers]
            specs += frontier
            exchanges = list(dict.fromkeys(getattr(args, "exchanges", None) or ["auto"]))
            value_dtype = getattr(args, "value_dtype", None)
            specs += [
                {"compressor": c, "density": d, "mode": m, "exchange": e, "value_dtype": value_dtype, **v}
                for d in args.densities
                for m in modes
                for c in args.compressors
                for e in (exchanges if COMPRESSORS[c].pattern == "gather" else ["auto"])
                for v in variants
                if m == "update" or not v
            ]
            results[task_name] = []
            for spec in specs:
                config = {**base, "mode": None, "peer": None, **spec}
                label = run_label(config)
                if _kind(config) == "sparse" and not config.get("label"):
                    label = f"{config['compressor']} {config['density']:g} ({label.split(' (', 1)[1]}"
                print(f"[{task_name}] {label} ...", end=" ", flush=True)
                result = launch(config, Path(tmp), args.timeout)
                results[task_name].append({**config, **result})
                value = _final(result, task.metric)
                if _ok(result) and value is not None:
                    print(
                        f"{task.metric.title} {value:.4f}, {_fmt_bytes(result['sent_bytes'])} sent, "
                        f"{result['fit_seconds']:.1f} s",
                        flush=True,
                    )
                else:
                    print(result["status"], flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "from_json")}
    descriptions = {}
    for name in results:
        tiny = TASKS[name].tiny_description if getattr(args, "tiny", False) else None
        descriptions[name] = TASKS[name].description + (f" ({tiny})" if tiny else "")
    return report(results, time.perf_counter() - started, settings, descriptions, out, args.json)
