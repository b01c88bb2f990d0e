"""Train an MLP on handwritten digits on 2 CPU processes: dense DDP, then sparse_ddp (top-k 1%, update mode).

    pip install torch==2.13.0 && pip install -e ".[examples]" && python examples/train_digits.py

Prints the validation accuracy of both runs and the compression sparse_ddp achieved
(dense bytes / bytes actually sent, over the whole run). Nothing is downloaded: the digits
ship inside scikit-learn.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch

import lightning_sparse  # registers strategy="sparse_ddp"
from lightning_sparse.demos import DigitsClassifier, DigitsDataModule, accuracy


def fit(
    strategy: str | L.pytorch.strategies.Strategy, args: argparse.Namespace, momentum: float
) -> tuple[L.Trainer, float, float]:
    L.seed_everything(args.seed, verbose=False)
    model = DigitsClassifier(lr=args.lr, momentum=momentum)
    data = DigitsDataModule(batch_size=args.batch_size)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    assert data.val_set is not None
    return trainer, accuracy(model, data.val_set), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--compressor", default="topk")
    parser.add_argument(
        "--compress",
        choices=["update", "gradient"],
        default="update",
        help="what the sparse run compresses (default: update; --momentum-correction implies gradient)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (both runs)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (both runs)")
    parser.add_argument(
        "--momentum-correction",
        action="store_true",
        help="sparse run: the hook applies the momentum (DGC momentum correction), the optimizer none",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)  # 2 processes on 2 cores
    _, dense_acc, dense_s = fit("ddp", args, args.momentum)
    correction = args.momentum if args.momentum_correction else 0.0
    sparse = lightning_sparse.SparseDDPStrategy(
        compress="gradient" if args.momentum_correction else args.compress,
        compressor=args.compressor,
        density=args.density,
        momentum_correction=correction,
    )
    trainer, sparse_acc, sparse_s = fit(sparse, args, 0.0 if args.momentum_correction else args.momentum)

    if trainer.is_global_zero:
        total = trainer.strategy.sparse_state.telemetry.total
        print()
        print(f"{'run':<32}{'val accuracy':>14}{'wall s':>9}")
        print(f"{'dense DDP':<32}{dense_acc:>14.4f}{dense_s:>9.1f}")
        mode = "gradient, mc" if args.momentum_correction else args.compress
        label = f"sparse_ddp {args.compressor} {args.density:g} ({mode})"
        print(f"{label:<32}{sparse_acc:>14.4f}{sparse_s:>9.1f}")
        print(
            f"accuracy difference: {100 * (sparse_acc - dense_acc):+.2f} points; "
            f"compression ratio (dense bytes / bytes sent): {total.message_ratio:.1f}x "
            f"({total.dense_bytes / 1e6:.2f} MB dense vs {total.sent_bytes / 1e6:.3f} MB sent per rank)"
        )


if __name__ == "__main__":
    main()
    # end the process group on every rank together and exit before Python's own shutdown, which can
    # abort while gloo's threads still free the last collective's tensors
    lightning_sparse.end_process_group(exit_code=0)
