"""Lightning's demo Transformer learning a per-token mapping, fitted under each strategy of a list and
validated after fit (the global model): tests/test_handover.py. Run as
``python tests/handover_worker.py config.json``; Lightning's popen launcher starts the other rank,
which runs every fit of the list too. Writes ``{name}_rank{r}.pt``."""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sparse
from lightning_sparse import SparseDDPStrategy
from lightning_sparse._utils import end_process_group

VOCAB, LENGTH = 32, 12


class MappingModel(L.LightningModule):
    """The demo Transformer called as a module, ``self.model(inputs, target)``, AdamW 1e-3."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=VOCAB, ninp=64, nhead=2, nhid=64, nlayers=1, dropout=0.0)

    def _loss(self, batch: Any) -> torch.Tensor:
        inputs, target = batch
        output = self.model(inputs, target)  # as Lightning's own demo calls it
        return nn.functional.nll_loss(output, target.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    mapping = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    inputs = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    return TensorDataset(inputs, mapping[inputs])


def fit_once(cfg: dict[str, Any]) -> None:
    L.seed_everything(0, verbose=False)
    model = MappingModel()
    spec = cfg["strategy"]
    strategy = spec if isinstance(spec, str) else SparseDDPStrategy(**spec)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=cfg["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train = DataLoader(make_data(16 * 2 * cfg["steps"], seed=1), batch_size=16)
    trainer.fit(model, train)
    train_loss = float(trainer.callback_metrics["train_loss"])  # this rank's view, as logged
    validation = DataLoader(make_data(256, seed=2), batch_size=128)
    val_loss = float(trainer.validate(model, validation, verbose=False)[0]["val_loss"])
    result: dict[str, Any] = {"val_loss": val_loss, "train_loss": train_loss}
    if isinstance(trainer.strategy, SparseDDPStrategy):
        telemetry = trainer.strategy.sparse_state.telemetry
        result["wire_bytes"] = telemetry.total.wire_bytes
        result["dense_wire_bytes"] = telemetry.total.dense_wire_bytes
        result["methods"] = {k: v.wire_bytes for k, v in telemetry.methods.items()}
    torch.save(result, f"{cfg['name']}_rank{trainer.global_rank}.pt")


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    for run in cfg.pop("runs"):
        fit_once({**cfg, **run})
    assert lightning_sparse.__version__


if __name__ == "__main__":
    main()
    end_process_group(exit_code=0)
