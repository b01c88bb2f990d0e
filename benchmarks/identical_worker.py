"""The fits ``python -m benchmarks identical`` compares, run as a script with the package under test
first on ``PYTHONPATH``:

    python benchmarks/identical_worker.py config.json

Started as a script (not ``-m benchmarks``), so that only ``PYTHONPATH`` decides which
``lightning_sparse`` it imports: the tree's or one extracted from git. It uses the package's public
names only (``SparseDDPStrategy``, ``SparseFSDPStrategy`` and their arguments) and Lightning's Trainer,
so the same driver runs on old and new code. Lightning's launcher starts the other ranks (they run
this script again). The config names the processes, the steps, the root the package must be imported
from and the runs; each rank of each run writes ``{name}_rank{r}.json``: a SHA-256 of its final
parameters (name, shape, dtype and bytes of each, in the module's order; under FSDP2 the local
shards), its mesh coordinate under ``sparse_fsdp``, the optimizer steps done and the losses.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any

#: the demo GPT, small: 2 blocks of width 64 (about 110k parameters, its matrices sent sparse)
MODEL: dict[str, Any] = {"context": 32, "width": 64, "layers": 2, "heads": 4, "lr": 3e-3}
#: per-process batch and training windows: 12 optimizer steps an epoch on 2 processes, 6 on 4
BATCH, WINDOWS = 16, 384
#: the Trainer's fixed options: CPU, nothing but the fit
TRAINER: dict[str, Any] = {
    "accelerator": "cpu",
    "max_epochs": -1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def parameter_digest(named: list[tuple[str, Any]]) -> str:
    """SHA-256 of parameters: each one's name, shape, dtype and bytes, in the order given.

    Example:
        >>> import torch
        >>> a = parameter_digest([("w", torch.zeros(2))])
        >>> a == parameter_digest([("w", torch.zeros(2))]), a == parameter_digest([("w", torch.ones(2))])
        (True, False)
    """
    import torch

    digest = hashlib.sha256()
    for name, p in named:
        local = p.to_local() if hasattr(p, "to_local") else p
        t = local.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _fit(cfg: dict[str, Any], run: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import lightning_sparse
    from lightning_sparse.demos import TinyGPT, load_gpt_tensors

    start = time.perf_counter()
    L.seed_everything(0, verbose=False)
    args = dict(run.get("args", {}))
    cls = (
        lightning_sparse.SparseFSDPStrategy if run["strategy"] == "sparse_fsdp" else lightning_sparse.SparseDDPStrategy
    )
    if "flush_at_end" in inspect.signature(cls).parameters:
        # the end-of-fit hand-over (a step of its own, new with flush_at_end) is left out: what is compared is
        # the exchange's steps, the same on a code without it
        args.setdefault("flush_at_end", False)
    strategy: Any = cls(**args)
    trainer = L.Trainer(devices=cfg["processes"], strategy=strategy, max_steps=cfg["steps"], **TRAINER)
    train, _ = load_gpt_tensors(context=MODEL["context"], n_train=WINDOWS, n_val=16, seed=0)

    class ByStep(TinyGPT):
        """The demo GPT, its batch chosen by the optimizer step and the rank (a fit resumed from a
        checkpoint sees the batches the uninterrupted one saw, whatever Lightning's loops restart);
        it keeps its losses and writes the run's checkpoint at the end of its epoch."""

        losses: list[float]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            first = (self.global_step * trainer.world_size + trainer.global_rank) * BATCH
            rows = torch.arange(first, first + BATCH) % WINDOWS
            loss = super().training_step((train.tensors[0][rows], train.tensors[1][rows]), batch_idx)
            self.losses.append(float(loss.detach()))
            return loss

        def on_train_epoch_end(self) -> None:
            if self.current_epoch == run.get("save_at_epoch"):
                trainer.save_checkpoint(run["checkpoint"])

    model = ByStep(**MODEL)
    model.losses = []
    # the loader only marks the epochs (its windows shared out among the processes)
    loader = DataLoader(train, batch_size=BATCH, shuffle=False, drop_last=True)
    resume = run.get("checkpoint") if run.get("save_at_epoch") is None else None
    trainer.fit(model, loader, ckpt_path=resume)
    rank = trainer.global_rank
    coords = None
    if run["strategy"] == "sparse_fsdp":
        coords = [int(c) for c in trainer.strategy.device_mesh.get_coordinate()]  # type: ignore[attr-defined]
    result = {
        "rank": rank,
        "digest": parameter_digest(list(model.named_parameters())),
        "coords": coords,
        "global_step": trainer.global_step,
        "losses": model.losses,
        "package": lightning_sparse.__file__,
        "torch": torch.__version__,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time(),  # this process's so far, the imports included
    }
    Path(cfg["out"], f"{run['name']}_rank{rank}.json").write_text(json.dumps(result))


def main(path: str) -> None:
    from _worker import start  # this script's folder: see benchmarks/_worker.py

    import lightning_sparse

    cfg = json.loads(Path(path).read_text())
    start(cfg["package_root"])
    for run in cfg["runs"]:
        _fit(cfg, run)
    lightning_sparse.end_process_group(exit_code=0)


if __name__ == "__main__":
    main(sys.argv[1])
