"""What a checkpoint costs: every process's extra memory at ``trainer.save_checkpoint`` and the files' size.

Each run fits an MLP with AdamW for a few steps on N CPU processes (``strategy``: ``ddp`` is the
baseline, dense DDP) and then saves one checkpoint; every process samples its resident memory
every millisecond during the save. A row gives, per strategy and number of processes, the largest
rise of rank 0's resident memory over its level before the save, the largest of the other ranks',
the checkpoint file's size and the size of the folder of per-process files beside it; the ratio
column is rank 0's rise against dense DDP's in the same run.

    python -m benchmarks checkpoint --processes 2 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._ranks import checkout_env

#: strategies of a run, the baseline first
STRATEGIES = ("ddp", "sparse_ddp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8], help="default: %(default)s")
    parser.add_argument("--width", type=int, default=2048, help="MLP width: 4 layers of width x width (default: 16.8M)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps before the save (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakSampler:
    """Samples this process's resident memory every millisecond in a thread; ``peak`` is the largest."""

    def __init__(self) -> None:
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _worker(config: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sparse  # noqa: F401  (registers sparse_ddp)

    width = config["width"]

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, width)), batch_size=4)
    strategy: Any = config["strategy"]
    if strategy == "sparse_ddp":
        # a save in the middle of training carries every process's residuals: the end-of-fit hand-over,
        # which empties them, is left out so that the save after fit costs what such a save costs
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
    trainer.fit(MLP(), data)
    path = Path(config["dir"]) / "model.ckpt"
    trainer.strategy.barrier()
    before = _rss_bytes()
    with _PeakSampler() as sampler:
        trainer.save_checkpoint(path)
    rank = trainer.global_rank
    Path(config["dir"], f"rank{rank}.json").write_text(json.dumps({"rank": rank, "rise": sampler.peak - before}))


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def measure(strategy: str, processes: int, width: int, steps: int, timeout: float) -> dict[str, Any]:
    """One run: rank 0's and the other ranks' largest memory rise at the save, and the files' sizes."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as tmp:
        config = {"strategy": strategy, "processes": processes, "width": width, "steps": steps, "dir": tmp}
        cmd = [sys.executable, "-m", "benchmarks", "checkpoint", "--worker", json.dumps(config)]
        env = checkout_env(dict(os.environ))
        done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"{strategy} on {processes} processes failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        rises = {r["rank"]: r["rise"] for r in (json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json"))}
        return {
            "strategy": strategy,
            "processes": processes,
            "rank0_rise": rises[0],
            "others_rise": max((v for k, v in rises.items() if k != 0), default=0),
            "file_bytes": _size(Path(tmp) / "model.ckpt"),
            "rank_files_bytes": _size(Path(tmp) / "model.ckpt.sparse"),
        }


def run(args: argparse.Namespace) -> int:
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    for flag, value in (("--width", args.width), ("--steps", args.steps)):
        if value < 1:
            raise ValueError(f"{flag}={value} is not allowed: expected an integer >= 1")
    if any(p < 1 for p in args.processes):
        raise ValueError(f"--processes {args.processes} is not allowed: expected integers >= 1")
    params = 4 * (args.width * args.width + args.width)
    print(f"MLP of {params / 1e6:.1f}M parameters, AdamW, {args.steps} steps, then trainer.save_checkpoint")
    print("| processes | strategy | rank 0 +MB | vs dense | other ranks +MB | file MB | per-process files MB |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    mb = 1e6
    for processes in args.processes:
        dense = None
        for strategy in STRATEGIES:
            row = measure(strategy, processes, args.width, args.steps, args.timeout)
            dense = dense or row
            row["rank0_vs_dense"] = row["rank0_rise"] / max(dense["rank0_rise"], 1)
            rows.append(row)
            print(
                f"| {processes} | {strategy} | {row['rank0_rise'] / mb:,.0f} | {row['rank0_vs_dense']:.2f}x | "
                f"{row['others_rise'] / mb:,.0f} | {row['file_bytes'] / mb:,.0f} | "
                f"{row['rank_files_bytes'] / mb:,.0f} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"parameters": params, "steps": args.steps, "rows": rows}, indent=1))
    return 0
