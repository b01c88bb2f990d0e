"""Fits of small BatchNorm models that call their network the ways LightningModules do, for
test_batchnorm.py (update mode, the popen launcher, one fit per entry of the config's ``runs``).

    python batchnorm_worker.py config.json

Patterns: ``self`` (``self(x)``), ``net`` (``self.net(x)``), ``kwargs`` (``self.net(pixel_values=x)``
returning a dict, Hugging Face style), ``chained`` (``self.head(self.backbone(x))``, BatchNorm in
both), ``helper`` (the network inside a helper method) and ``forward_only`` (``self.net.forward(x)``,
whose layers are called through their ``forward`` too: nothing the strategy can replay). Every rank
writes ``{name}_rank{r}.pt``: the module's state after the fit and after a ``trainer.validate`` on
the same Trainer, the BatchNorm statistics as training left them (the last batch end), and the
warnings raised.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from trainer_worker import build_strategy, make_data

from lightning_sparse._utils import end_process_group


class _KeywordNet(nn.Module):
    """A network called with a keyword argument, returning a dict (as Hugging Face models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, pixel_values: Tensor) -> dict[str, Tensor]:
        return {"logits": self.body(pixel_values)}


class _ForwardOnlyNet(nn.Module):
    """A network whose layers are called through ``.forward``: no module hook ever fires."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.bn, self.lin2 = nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin2.forward(torch.relu(self.bn.forward(self.lin1.forward(x))))


class PatternNet(L.LightningModule):
    """A classifier of the worker's data whose training forward follows ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern
        self.data: Any = None
        self.trained_stats: dict[str, Tensor] = {}
        if pattern == "chained":
            self.backbone = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU())
            self.head = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        elif pattern == "kwargs":
            self.net: nn.Module = _KeywordNet()
        elif pattern == "forward_only":
            self.net = _ForwardOnlyNet()
        else:
            self.net = nn.Sequential(
                nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                nn.Linear(32, 4),
            )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def logits(self, x: Tensor) -> Tensor:
        """The training forward, written the way ``pattern`` says (the test replays it by hand)."""
        if self.pattern == "self":
            return self(x)
        if self.pattern == "kwargs":
            return self.net(pixel_values=x)["logits"]
        if self.pattern == "chained":
            return self.head(self.backbone(x))
        if self.pattern == "helper":
            return self._helper(x)
        if self.pattern == "forward_only":
            return self.net.forward(x)
        return self.net(x)

    def _helper(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        # data as a function of (step, rank), as in trainer_worker.py
        n, bs, world = len(self.data), batch[0].shape[0], self.trainer.world_size
        start = (self.global_step * world + self.global_rank) * bs
        idx = torch.arange(start, start + bs) % n
        x, y = self.data.tensors[0][idx], self.data.tensors[1][idx]
        return nn.functional.cross_entropy(self.logits(x), y)

    def on_train_batch_end(self, *args: Any) -> None:
        self.trained_stats = {k: v.clone() for k, v in self.state_dict().items() if "running" in k}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        with torch.no_grad():
            loss = nn.functional.cross_entropy(self.logits(x), y)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit_once(cfg: dict[str, Any]) -> None:
    L.seed_everything(0, verbose=False)
    model = PatternNet(cfg["pattern"])
    data = make_data(0, cfg["n"])
    model.data = data
    loader = DataLoader(data, batch_size=16, shuffle=False)
    val_loader = DataLoader(data, batch_size=len(data), shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=build_strategy(cfg["strategy"]),
        max_steps=cfg["max_steps"],
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader, val_loader)
        fitted = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainer.validate(model, val_loader, verbose=False)
    result = {
        "fit": fitted,
        "validated": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "trained_stats": model.trained_stats,
        "warnings": [str(w.message) for w in caught],
        "telemetry": trainer.strategy.sparse_state.telemetry.total.as_dict(),
    }
    torch.save(result, f"{cfg['name']}_rank{trainer.global_rank}.pt")


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    for run in cfg.pop("runs"):
        fit_once({**cfg, **run})


if __name__ == "__main__":
    main()
    end_process_group(exit_code=0)
