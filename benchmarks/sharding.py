"""Memory per process under ``sparse_ddp`` and ``sparse_fsdp``: each process's training state, counted.

Each run fits a model of ``--blocks`` residual MLP blocks of width ``--width`` with AdamW for a few
steps on N CPU processes, with ``sparse_ddp`` and with ``sparse_fsdp`` in groups of
``--shard-size``, both in update mode at their defaults (but for the end-of-fit hand-over, left out
so that the residuals are counted as training holds them). Then every process counts the bytes of the
tensors it holds for training: its parameters (its shards under FSDP2), gradients, optimizer state,
the residual and update mode's global copy; the ratio column is ``sparse_fsdp``'s total against
``sparse_ddp``'s in the same run (0.5 is the ideal with groups of 2). The peak resident memory of
the process is printed beside it (the interpreter, torch and the data are in it too); under
``sparse_fsdp`` the model is built on the meta device (``trainer.init_module(empty_init=True)``), so
that no process ever holds the whole model.

    python -m benchmarks sharding --processes 4 --shard-size 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._ranks import checkout_env, free_port

PARTS = ("parameters", "gradients", "optimizer", "residual", "global copy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--processes", type=int, default=4, help="default: %(default)s")
    parser.add_argument("--shard-size", type=int, default=2, help="processes per group (default: %(default)s)")
    parser.add_argument("--width", type=int, default=1024, help="block width (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=8, help="blocks (default: %(default)s: 8.4M parameters)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def _bytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def _worker(config: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sparse

    width = config["width"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(self.norm(x)))

    class Blocks(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(config["blocks"])])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self(x).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    if config["strategy"] == "sparse_fsdp":
        strategy: Any = lightning_sparse.SparseFSDPStrategy(
            shard_size=config["shard_size"], sharded_modules=["Block"], flush_at_end=False
        )
    else:
        strategy = lightning_sparse.SparseDDPStrategy(flush_at_end=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=config["processes"],
        strategy=strategy,
        max_steps=config["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if config["strategy"] == "sparse_fsdp":
        # on the meta device: only the shards are ever materialized, never the whole model
        with trainer.init_module(empty_init=True):
            model = Blocks()
    else:
        model = Blocks()
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(16 * config["processes"], width)), batch_size=4))
    state = trainer.strategy.sparse_state  # type: ignore[attr-defined]
    update = trainer.strategy.update_exchange  # type: ignore[attr-defined]
    optimizer = trainer.optimizers[0]
    counts = {
        "parameters": sum(_bytes(p) for p in model.parameters()),
        "gradients": sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer": sum(_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
        "residual": sum(_bytes(e) for e in state.memory._residuals.values()),
        "global copy": sum(_bytes(g) for g in update._global.values()),
    }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = trainer.global_rank
    Path(config["dir"], f"rank{rank}.json").write_text(json.dumps({"rank": rank, **counts, "peak_rss": peak}))


def measure(
    strategy: str, processes: int, shard_size: int, width: int, blocks: int, steps: int, timeout: float
) -> dict[str, Any]:
    """One run: every process's counted training state, and the largest over the processes."""
    with tempfile.TemporaryDirectory(prefix="sharding_bench_") as tmp:
        config = {
            "strategy": strategy,
            "processes": processes,
            "shard_size": shard_size,
            "width": width,
            "blocks": blocks,
            "steps": steps,
            "dir": tmp,
        }
        env = checkout_env(dict(os.environ))
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"})
        for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
            env.pop(key, None)
        cmd = [sys.executable, "-m", "benchmarks", "sharding", "--worker", json.dumps(config)]
        done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"{strategy} on {processes} processes failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    largest = max(ranks, key=lambda r: sum(r[k] for k in PARTS))
    return {
        "strategy": strategy,
        "ranks": ranks,
        **{k: largest[k] for k in PARTS},
        "total": sum(largest[k] for k in PARTS),
        "peak_rss": max(r["peak_rss"] for r in ranks),
    }


def run(args: argparse.Namespace) -> int:
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    for flag, value in (
        ("--processes", args.processes),
        ("--shard-size", args.shard_size),
        ("--width", args.width),
        ("--blocks", args.blocks),
        ("--steps", args.steps),
    ):
        if value < 1:
            raise ValueError(f"{flag}={value} is not allowed: expected an integer >= 1")
    if args.processes % args.shard_size:
        raise ValueError(
            f"--shard-size={args.shard_size} is not allowed: expected a divisor of --processes={args.processes}"
        )
    params = args.blocks * (args.width * args.width + 3 * args.width)
    print(
        f"{args.blocks} blocks of width {args.width} ({params / 1e6:.1f}M parameters), AdamW, "
        f"{args.processes} processes; sparse_fsdp in groups of {args.shard_size}. MB per process (the largest):"
    )
    print("| strategy | " + " | ".join(PARTS) + " | total | vs sparse_ddp | peak resident MB |")
    print("| --- |" + " ---: |" * (len(PARTS) + 3))
    rows = []
    for strategy in ("sparse_ddp", "sparse_fsdp"):
        row = measure(strategy, args.processes, args.shard_size, args.width, args.blocks, args.steps, args.timeout)
        row["vs_ddp"] = row["total"] / rows[0]["total"] if rows else 1.0
        rows.append(row)
        cells = " | ".join(f"{row[k] / 1e6:,.1f}" for k in PARTS)
        print(
            f"| {strategy} | {cells} | {row['total'] / 1e6:,.1f} | {row['vs_ddp']:.2f}x | "
            f"{row['peak_rss'] / 1e6:,.0f} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"parameters": params, "args": vars(args), "rows": rows}, indent=1))
    return 0
