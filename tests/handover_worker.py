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
from lightning.pytorch.trainer.states import TrainerFn
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


class ValidationLog(L.Callback):
    """Each validation inside fit: the step, the logged val loss and the wire bytes through this rank
    so far. ``hand_over``: validate the global model plus the mean of every rank's residual (one
    dense float32 all-reduce of the parameters, its bytes counted apart), then put the global model
    back, so that training goes on from it."""

    def __init__(self, hand_over: bool) -> None:
        self.hand_over = hand_over
        self.points: list[dict[str, float]] = []
        self.hand_over_bytes = 0
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        update = getattr(trainer.strategy, "update_exchange", None)
        if not self.hand_over or update is None or trainer.state.fn != TrainerFn.FITTING:
            return
        memory = trainer.strategy.sparse_state.memory
        params = [p for p in pl_module.parameters() if update.name_of(p) is not None]
        parts = []
        for p in params:
            name = update.name_of(p)
            e = memory.get(name) if name in memory else None
            parts.append(torch.zeros(p.numel()) if e is None else e.detach().reshape(-1).float())
        flat = torch.cat(parts)
        torch.distributed.all_reduce(flat)
        self.hand_over_bytes += flat.numel() * flat.element_size()  # at 2 ranks, the ring moves its size
        flat.div_(trainer.world_size)
        self._saved, pos = [], 0
        with torch.no_grad():
            for p in params:
                self._saved.append((p, p.detach().clone()))
                p.add_(flat[pos : pos + p.numel()].view_as(p))
                pos += p.numel()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with torch.no_grad():
            for p, value in self._saved:
                p.copy_(value)
        self._saved = []
        if trainer.state.fn != TrainerFn.FITTING:
            return
        telemetry = getattr(getattr(trainer.strategy, "sparse_state", None), "telemetry", None)
        wire = 0.0 if telemetry is None else telemetry.total.wire_bytes
        loss = float(trainer.callback_metrics["val_loss"])
        self.points.append({"step": trainer.global_step, "val_loss": loss, "wire_bytes": wire})


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
    # "val_every": validate inside fit every that many steps too ("hand_over_in_val": on global + mean e)
    log = ValidationLog(bool(cfg.get("hand_over_in_val")))
    every = cfg.get("val_every")
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
        val_check_interval=every,
        check_val_every_n_epoch=None if every else 1,
        callbacks=[log],
    )
    train = DataLoader(make_data(16 * 2 * cfg["steps"], seed=1), batch_size=16)
    validation = DataLoader(make_data(256, seed=2), batch_size=128)
    trainer.fit(model, train, validation if every else None)
    train_loss = float(trainer.callback_metrics["train_loss"])  # this rank's view, as logged
    val_loss = float(trainer.validate(model, validation, verbose=False)[0]["val_loss"])
    result: dict[str, Any] = {"val_loss": val_loss, "train_loss": train_loss}
    result.update(validations=log.points, hand_over_in_val_bytes=log.hand_over_bytes)
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
