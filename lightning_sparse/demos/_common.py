"""What the demo tasks share: data loading, cross-entropy training and validation, gradient-norm clipping."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class _DataModule(L.LightningDataModule):
    """The (train, validation) TensorDatasets of :meth:`load`, made on the first ``setup``: training batches
    of ``batch_size`` shuffled (the last short one dropped), validation batches of ``val_batch_size``."""

    batch_size: int
    val_batch_size = 256
    train_set: TensorDataset | None = None
    val_set: TensorDataset | None = None

    def load(self) -> tuple[TensorDataset, TensorDataset]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self.load()

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.val_batch_size)


class _Classifier(L.LightningModule):
    """Cross-entropy training and validation (``val_loss``, ``val_acc``) over every position of the logits."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, -2), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        # equal token counts per window: the batch-weighted mean is the mean over all validation tokens
        logits, y = self(x).flatten(0, -2), y.flatten()
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)


class _NormClipping(L.LightningModule):
    """Gradient-norm clipping at the ``clip`` hyperparameter; the Trainer's ``gradient_clip_val`` overrides it."""

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Any = None,
    ) -> None:
        clip = self.hparams["clip"] if gradient_clip_val is None else gradient_clip_val
        if clip is not None:
            self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")
