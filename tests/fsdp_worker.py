"""A Trainer fit with ``sparse_fsdp`` (or FSDP2 / DDP baselines) on a small model of blocks, launched by
tests/test_fsdp_trainer.py through Lightning's popen launcher:

    python fsdp_worker.py config.json

Each rank saves what the test checks to ``[name_]rank{r}.pt``: its local shards of the global model
after the fit (and their checksum), the losses, the telemetry, the mesh coordinates and, with
``validate``, the validation loss.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_sparse
from lightning_sparse import end_process_group

WIDTH = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Blocks(L.LightningModule):
    def __init__(self, lr: float = 0.03, self_sharded: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.out = nn.Linear(WIDTH, 1)
        self.lr = lr
        self.self_sharded = self_sharded
        self.losses: list[float] = []
        self.batches: list[float] = []

    def configure_model(self) -> None:
        if not self.self_sharded:
            return
        from torch.distributed.fsdp import fully_shard

        names = self.device_mesh.mesh_dim_names or ()
        mesh = self.device_mesh["shard" if "shard" in names else "data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        for module in (self.inp, self.blocks, self.out):
            fully_shard(module, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x))).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = (self(x) - y).pow(2).mean()
        self.losses.append(float(loss.detach()))
        self.batches.append(float(x.sum()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", (self(x) - y).pow(2).mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class _SaveAtEpochEnd(L.Callback):
    """Write a checkpoint at the end of a given epoch (end-of-epoch: the reliable resume point)."""

    def __init__(self, epoch: int, path: str) -> None:
        self.epoch, self.path = epoch, path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, generator=torch.Generator().manual_seed(7))
    return TensorDataset(x, torch.sin(x @ w))


def _strategy(cfg: dict[str, Any]) -> Any:
    name = cfg.get("strategy", "sparse_fsdp")
    if name == "sparse_fsdp":
        return lightning_sparse.SparseFSDPStrategy(**cfg.get("args", {}))
    if name == "fsdp2":  # plain FSDP2 on the same mesh layout: Lightning's ModelParallelStrategy
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=cfg["devices"], tensor_parallel_size=1)
    return lightning_sparse.SparseDDPStrategy(**cfg.get("args", {}))


def fit_once(cfg: dict[str, Any]) -> None:
    L.seed_everything(0, verbose=False)
    model = Blocks(self_sharded=cfg.get("self_sharded", False))
    trainer = L.Trainer(
        accelerator=cfg.get("accelerator", "cpu"),
        devices=cfg["devices"],
        strategy=_strategy(cfg),
        max_steps=cfg["steps"],
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        limit_val_batches=2 if cfg.get("validate") else 0,
        gradient_clip_val=cfg.get("gradient_clip_val"),
        precision=cfg.get("precision", "32-true"),
        callbacks=[_SaveAtEpochEnd(cfg.get("save_epoch", 0), cfg["save_at_epoch_end"])]
        if cfg.get("save_at_epoch_end")
        else [],
    )
    # each process its own rows, in the same order every epoch: a resumed run sees the batches the
    # uninterrupted one saw (Lightning's own sampler reshuffles per epoch, and a strategy that restores
    # after setup, as Lightning's ModelParallelStrategy does, starts the resumed epoch's order late)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    rows = _data(cfg.get("samples", 512), 1)
    sampler = DistributedSampler(rows, num_replicas=cfg["devices"], rank=rank, shuffle=False)
    train = DataLoader(rows, batch_size=8, sampler=sampler)
    val_rows = _data(64, 2)
    val = DataLoader(val_rows, batch_size=16, sampler=DistributedSampler(val_rows, cfg["devices"], rank, shuffle=False))
    ckpt = cfg.get("resume_from")
    trainer.fit(model, train, val if cfg.get("validate") else None, ckpt_path=ckpt)
    result: dict[str, Any] = {"losses": model.losses, "batches": model.batches, "global_step": trainer.global_step}
    params = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params[name] = local.detach().clone()
    result["params"] = params
    result["checksum"] = sum(float(t.double().sum()) for t in params.values())
    strategy = trainer.strategy
    if isinstance(strategy, lightning_sparse.SparseFSDPStrategy):
        result["coords"] = strategy.device_mesh.get_coordinate()
        result["shard_size"] = strategy.shard_size
    if hasattr(strategy, "sparse_state"):
        state = strategy.sparse_state
        result["telemetry"] = state.telemetry.total.as_dict()
        result["group_bytes"] = state.telemetry.group_bytes
        result["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        result["residuals"] = state.memory.state_dict()
    if cfg.get("validate"):
        result["val_loss"] = float(trainer.validate(model, val, verbose=False)[0]["val_loss"])
    prefix = f"{cfg['name']}_" if cfg.get("name") else ""
    torch.save(result, f"{prefix}rank{trainer.global_rank}.pt")


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    runs = cfg.pop("runs", None)
    for run in runs or [{}]:
        fit_once({**cfg, **run})


if __name__ == "__main__":
    main()
    end_process_group(exit_code=0)
