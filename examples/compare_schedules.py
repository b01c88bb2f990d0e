"""Density schedules compared on the digits task: bits sent to reach a target accuracy.

    python examples/compare_schedules.py                     # 2 CPU processes, 3 seeds, ~10 minutes
    python examples/compare_schedules.py --seeds 0 --epochs 10   # a quick look

Trains the digits MLP (lightning_sparse.demos) with top-k and error feedback under each
schedule — constant densities 0.1, 0.01 and 0.001, an exponential warm-up 0.25 -> 0.001, and
AdaptiveDensity (the improvement-per-bit rule) — validates every few steps, and prints a markdown
table: the bits each rank put into its collectives (telemetry, counted from the tensors handed
to torch.distributed) until the validation accuracy first reached the target, the steps that
took, the final accuracy, the accuracy at equal bits (when every run had sent what the thriftiest
one sent in all), and the modeled cost ``sum over messages of (c0 + payload bits)`` of the bits
cost model the adaptive rule optimises. Accuracy is the mean of the last ``--smooth`` validations
(single validations on 359 images swing by a few points). Medians over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import lightning as L
import torch

import lightning_sparse
from lightning_sparse import AdaptiveDensity, ConstantDensity, DensitySchedule, WarmupDensity
from lightning_sparse.demos import DigitsClassifier, DigitsDataModule


class Recorder(L.Callback):
    """Per validation: step, accuracy, bits sent so far and messages sent so far (this rank)."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []
        self.densities: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        state = trainer.strategy.sparse_state
        last = state.telemetry.last
        if last.fallback_buckets or last.dense_buckets == last.buckets:
            self.densities.append(1.0)
        else:
            sparse_numel = sum(
                p.numel() for p in trainer.lightning_module.parameters() if p.numel() >= state.config.min_numel
            )
            dense_numel = last.numel - sparse_numel
            self.densities.append((last.sent_numel - dense_numel) / sparse_numel)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        total = trainer.strategy.sparse_state.telemetry.total
        self.points.append(
            {
                "step": trainer.global_step,
                "acc": float(trainer.callback_metrics["val_acc"]),
                "bits": 8.0 * total.sent_bytes,
                # one collective per bucket, plus one for its small dense tensors when it goes sparse
                # (every bucket of this model has both)
                "messages": float(total.buckets + total.buckets - total.dense_buckets),
            }
        )


def schedules(args: argparse.Namespace, steps_per_epoch: int) -> dict[str, DensitySchedule]:
    return {
        "constant 0.1": ConstantDensity(0.1),
        "constant 0.01": ConstantDensity(0.01),
        "constant 0.001": ConstantDensity(0.001),
        f"warm-up 0.25 -> 0.001 ({args.warmup_epochs} epochs)": WarmupDensity(
            0.25, 0.001, steps=args.warmup_epochs * steps_per_epoch
        ),
        **{
            f"adaptive (bits, c0 = {c0:g})": AdaptiveDensity(
                cost_model="bits", c0=c0, min_density=args.min_density, max_density=args.max_density
            )
            for c0 in args.c0
        },
    }


def fit(name: str, schedule: DensitySchedule, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    L.seed_everything(seed, verbose=False)
    model = DigitsClassifier(lr=args.lr)
    data = DigitsDataModule(batch_size=args.batch_size, seed=0)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=lightning_sparse.SparseDDPStrategy(
            compressor="topk", density=schedule, error_feedback=not args.no_error_feedback
        ),
        max_epochs=args.epochs,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    return {
        "name": name,
        "seed": seed,
        "points": recorder.points,
        "densities": recorder.densities,
        "seconds": time.perf_counter() - start,
        "rank0": trainer.is_global_zero,
    }


def first_reaching(points: list[dict[str, float]], target: float, smooth: int) -> dict[str, float] | None:
    """The first validation point at which the mean accuracy of the last ``smooth`` ones reaches ``target``."""
    for i, pt in enumerate(points):
        window = points[max(0, i - smooth + 1) : i + 1]
        if len(window) == smooth and statistics.fmean(p["acc"] for p in window) >= target:
            return pt
    return None


def accuracy_at(points: list[dict[str, float]], bits: float, smooth: int) -> float:
    """Mean accuracy of the last ``smooth`` validations before the run had sent more than ``bits``."""
    upto = [pt for pt in points if pt["bits"] <= bits * (1 + 1e-9)] or points[:1]
    return statistics.fmean(pt["acc"] for pt in upto[-smooth:])


def summarise(runs: list[dict[str, Any]], target: float, c0s: list[float], smooth: int) -> list[str]:
    names = list(dict.fromkeys(r["name"] for r in runs))
    cost_heads = "".join(f" cost to {target:.0%}, c0 = {c0:g} |" for c0 in c0s)
    # equal bits: the accuracy every schedule had when it had sent what the thriftiest run sent in all
    budget = min(statistics.median(r["points"][-1]["bits"] for r in runs if r["name"] == n) for n in names)
    rows = [
        f"| schedule | mean density | steps to {target:.0%} | Mbit to {target:.0%} | reached | final accuracy "
        f"| Mbit in all | accuracy at {budget / 1e6:.1f} Mbit |{cost_heads}",
        "| --- |" + " ---: |" * (7 + len(c0s)),
    ]
    for name in names:
        mine = [r for r in runs if r["name"] == name]
        hits = [first_reaching(r["points"], target, smooth) for r in mine]
        reached = [h for h in hits if h is not None]

        def med(values: list[float]) -> float:
            return statistics.median(values) if values else float("nan")

        bits = med([h["bits"] for h in reached]) / 1e6
        steps = med([h["step"] for h in reached])
        costs = "".join(f" {med([h['bits'] + c0 * h['messages'] for h in reached]) / 1e6:.2f} |" for c0 in c0s)
        final = med([statistics.fmean(p["acc"] for p in r["points"][-smooth:]) for r in mine])
        total = med([r["points"][-1]["bits"] for r in mine]) / 1e6
        density = med([statistics.fmean(r["densities"][1:]) for r in mine])
        at_budget = med([accuracy_at(r["points"], budget, smooth) for r in mine])
        row = (
            f"| {name} | {density:.4f} | {steps:.0f} | {bits:.2f} | {len(reached)}/{len(mine)} | {final:.4f} "
            f"| {total:.1f} | {at_budget:.4f} |{costs}"
        )
        rows.append(row.replace(" nan ", " - "))  # not reached
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.95, help="validation accuracy to reach")
    parser.add_argument("--val-every", type=int, default=11, help="validate every this many steps")
    parser.add_argument("--warmup-epochs", type=int, default=4)
    parser.add_argument(
        "--c0", type=float, nargs="+", default=[1e4, 1e5], help="per-message overhead in bits: one adaptive run each"
    )
    parser.add_argument("--min-density", type=float, default=0.0005)
    parser.add_argument("--max-density", type=float, default=0.25)
    parser.add_argument("--only", nargs="*", default=None, help="substrings of schedule names to run")
    parser.add_argument("--json", default=None, help="also write every run's validation points here")
    parser.add_argument("--no-error-feedback", action="store_true", help="drop what is not sent")
    parser.add_argument(
        "--smooth", type=int, default=3, help="target reached when the mean of this many validations reaches it"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)  # 2 processes on 2 cores
    n_train = 1797 - round(0.2 * 1797)
    steps_per_epoch = n_train // (args.batch_size * args.devices)
    runs = []
    for seed in args.seeds:
        for name, schedule in schedules(args, steps_per_epoch).items():
            if args.only and not any(s in name for s in args.only):
                continue
            runs.append(fit(name, schedule, seed, args))
    if runs and runs[0]["rank0"]:
        print()
        print(
            f"digits MLP 64-512-256-10 (166,400 weights sent sparse, biases dense), top-k "
            f"{'without' if args.no_error_feedback else 'with'} error feedback, "
            f"{args.devices} processes x batch {args.batch_size}, SGD lr {args.lr} momentum 0.9, "
            f"{args.epochs} epochs ({steps_per_epoch} steps each), validation every {args.val_every} steps, "
            f"seeds {args.seeds} (medians)"
        )
        print()
        print("\n".join(summarise(runs, args.target, args.c0, args.smooth)))
        print()
        print(
            "Mbit: what each rank put into its collectives (values, int32 indices, the dense biases, the dense "
            "first step), counted by the strategy's telemetry. cost: Mbit + c0 x messages sent (2 per sparse "
            "step here: the top-k all-gather and the all-reduce of the biases; 1 per dense step), the bits "
            "cost model the adaptive rule maximises improvement against."
        )
        print()
        print(f"wall time: {sum(r['seconds'] for r in runs):.0f} s for {len(runs)} runs")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "runs": runs}, f)


if __name__ == "__main__":
    main()
    # end the process group on every rank together and exit before Python's own shutdown, which can
    # abort while gloo's threads still free the last collective's tensors
    lightning_sparse.end_process_group(exit_code=0)
