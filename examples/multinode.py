"""The digits MLP with ``strategy="sparse_ddp"`` on ``--num-nodes`` x ``--devices`` processes.

A script for external launchers: ``torchrun`` and SLURM's ``srun`` start every process themselves
(Lightning reads their environment variables), so ``--num-nodes`` and ``--devices`` must match what
the launcher starts: ``--nnodes`` and ``--nproc-per-node`` for torchrun, the nodes and
``--ntasks-per-node`` for srun.

    torchrun --nnodes 1 --nproc-per-node 2 examples/multinode.py --devices 2
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

import lightning_sparse  # noqa: F401  (registers strategy="sparse_ddp")
from lightning_sparse.tasks import DigitsClassifier, DigitsDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (torchrun --nnodes)")
    parser.add_argument("--devices", type=int, default=2, help="processes per machine (--nproc-per-node)")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL; never run by the tests)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    args = parser.parse_args()

    if args.accelerator == "cpu":
        torch.set_num_threads(1)
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="sparse_ddp",
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=False,
    )
    model, data = DigitsClassifier(hidden=(128,)), DigitsDataModule(batch_size=32)
    trainer.fit(model, data)
    (metrics,) = trainer.validate(model, data, verbose=False)  # the global model, on every rank
    if trainer.global_rank == 0:
        env = type(trainer.strategy.cluster_environment).__name__
        print(f"world size {trainer.world_size} ({env}): val_acc {metrics['val_acc']:.4f}")


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # end the process group on every rank together, then exit
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
