"""A Lightning training run driven by a JSON config, for the distributed Trainer tests.

    python trainer_worker.py config.json

Lightning's popen launcher re-runs this script for the other ranks. Every rank writes
``rank{r}.pt`` into the working directory: its final parameters, the hook's step and telemetry.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sparse
from lightning_sparse import SparseDDPStrategy


class Net(L.LightningModule):
    """A small MLP; variants exercise unused and frozen parameters and non-finite gradients."""

    def __init__(self, variant: str = "mlp", lr: float = 0.05, nan_at_step: int = -1) -> None:
        super().__init__()
        self.variant = variant
        self.lr = lr
        self.nan_at_step = nan_at_step
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        if variant == "unused":
            self.unused = nn.Linear(64, 64)  # never in the graph
        if variant == "frozen":
            for p in self.body[0].parameters():
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        if self.global_step == self.nan_at_step:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


def make_data(seed: int = 0, n: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 4, generator=g)
    y = (x @ w).argmax(1)
    return TensorDataset(x, y)


@torch.no_grad()
def _accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)).argmax(1) == y).float().mean().item()


def build_strategy(spec: Any) -> Any:
    if isinstance(spec, str):
        return spec
    spec = dict(spec)
    args = spec.pop("compressor_args", None)
    if args is not None:  # a compressor built from its class with typed arguments
        spec["compressor"] = lightning_sparse.COMPRESSORS[spec.get("compressor", "topk")](**args)
    return SparseDDPStrategy(**spec)


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    model = Net(cfg.get("model", "mlp"), cfg.get("lr", 0.05), cfg.get("nan_at_step", -1))
    data = make_data(cfg.get("seed", 0))
    initial_acc = _accuracy(model, data)
    # shuffle=False: the data order must not depend on anything but the step (resume tests)
    loader = DataLoader(data, batch_size=cfg.get("batch_size", 16), shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 2),
        strategy=build_strategy(cfg.get("strategy", "sparse_ddp")),
        max_steps=cfg.get("max_steps", 30),
        max_epochs=-1,
        accumulate_grad_batches=cfg.get("accumulate_grad_batches", 1),
        precision=cfg.get("precision", "32-true"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader, ckpt_path=cfg.get("ckpt_path"))
    if cfg.get("save_ckpt"):
        trainer.save_checkpoint(cfg["save_ckpt"])
    result: dict[str, Any] = {
        "params": {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()},
        "global_step": trainer.global_step,
        "initial_acc": initial_acc,
        "train_acc": _accuracy(model, data),
    }
    strategy = trainer.strategy
    if isinstance(strategy, SparseDDPStrategy):
        state = strategy.sparse_state
        result["hook_step"] = state.step
        result["telemetry"] = state.telemetry.total.as_dict()
        result["residuals"] = state.memory.state_dict()
    torch.save(result, f"rank{trainer.global_rank}.pt")
    assert lightning_sparse.__version__


if __name__ == "__main__":
    main()
