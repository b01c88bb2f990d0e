"""The digits MLP with ``SparseDDPStrategy`` (``strategy="sparse_ddp"``) on ``--num-nodes`` x ``--devices`` processes.

A script for external launchers: ``torchrun`` and SLURM's ``srun`` start every process themselves
(Lightning reads their environment variables), so ``--num-nodes`` and ``--devices`` must match what
the launcher starts: ``--nnodes`` and ``--nproc-per-node`` for torchrun, the nodes and
``--ntasks-per-node`` for srun.

    torchrun --nnodes 1 --nproc-per-node 2 examples/multinode.py --devices 2

``--save-checkpoint`` and ``--ckpt-path`` write and resume a checkpoint, also on another number of
processes (see the resize rule in docs/guarantees.md).

``--compress`` picks the mode: ``update`` (the default, as with ``strategy="sparse_ddp"``) or
``gradient``. With ``--digest-dir DIR`` every rank writes ``DIR/rank{global_rank}.json`` after
training: a SHA-256 of the model's parameters and the rank's place (global, node and local rank,
world size), to check that all replicas ended identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import lightning as L
import torch

import lightning_sparse  # registers strategy="sparse_ddp"
from lightning_sparse.demos import DigitsClassifier, DigitsDataModule


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in the module's order: equal only for identical replicas."""
    sha = hashlib.sha256()
    for param in model.parameters():
        sha.update(param.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (torchrun --nnodes)")
    parser.add_argument("--devices", type=int, default=2, help="processes per machine (--nproc-per-node)")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL; never run by the tests)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    parser.add_argument("--compress", choices=("update", "gradient"), default="update", help="what is compressed")
    parser.add_argument("--digest-dir", type=Path, help="every rank writes rank{global_rank}.json here")
    parser.add_argument("--save-checkpoint", type=Path, help="write a checkpoint here after training")
    parser.add_argument(
        "--ckpt-path", type=Path, help="resume from this checkpoint (it may come from another number of processes)"
    )
    args = parser.parse_args()

    if args.accelerator == "cpu":
        torch.set_num_threads(1)
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        # strategy="sparse_ddp" builds this strategy with its defaults (compress="update")
        strategy=lightning_sparse.SparseDDPStrategy(compress=args.compress),
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=False,
    )
    model, data = DigitsClassifier(hidden=(128,)), DigitsDataModule(batch_size=32)
    trainer.fit(model, data, ckpt_path=args.ckpt_path)
    if args.save_checkpoint is not None:
        trainer.save_checkpoint(args.save_checkpoint)  # every rank's residuals go in it
    (metrics,) = trainer.validate(model, data, verbose=False)  # the global model, on every rank
    if trainer.global_rank == 0:
        env = type(trainer.strategy.cluster_environment).__name__
        print(
            f"world size {trainer.world_size} ({env}), compress {args.compress}: step {trainer.global_step}, "
            f"val_loss {metrics['val_loss']:.4f}, val_acc {metrics['val_acc']:.4f}"
        )
    if args.digest_dir is not None:
        args.digest_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "sha256": parameter_digest(model),
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
        }
        (args.digest_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    # end the process group on every rank together and exit before Python's own shutdown, which can
    # abort while gloo's threads still free the last collective's tensors
    lightning_sparse.end_process_group(exit_code=0)
