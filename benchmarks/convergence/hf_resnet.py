"""A Hugging Face ``ResNetForImageClassification`` (the ResNet-18 shape, BatchNorm throughout) held in
``self.net`` and called with keyword arguments, the way Hugging Face vision models are trained with
Lightning: the ``hf-resnet`` task of the convergence benchmark.

Built from a ``ResNetConfig``, nothing downloaded. The Hugging Face embedder (a 7x7 stride-2
convolution and a stride-2 max-pool, the ImageNet stem) shrinks the task's 32x32 images to 8x8
before the first stage; the model is kept as users get it.

Needs the ``transformers`` package (the ``bench`` extra; not a dependency of the library).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn


class HFResNet(L.LightningModule):
    """``ResNetForImageClassification`` (basic blocks, BatchNorm after every convolution, 1-channel
    input, 10 classes) in ``self.net``; every step calls ``self.net(pixel_values=x).logits`` and never
    ``self(...)``. SGD with momentum and weight decay (the ``vision`` task's optimizer).

    Args:
        embedding_size: channels of the stem (64: ResNet-18).
        hidden_sizes: channels of each stage.
        depths: basic blocks per stage.
        lr: learning rate.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.

    Example:
        >>> model = HFResNet(embedding_size=4, hidden_sizes=(4, 8), depths=(1, 1))
        >>> model.net(pixel_values=torch.zeros(2, 1, 16, 16)).logits.shape
        torch.Size([2, 10])
        >>> model.training_step((torch.zeros(2, 1, 16, 16), torch.tensor([0, 1])), 0).shape
        torch.Size([])
    """

    def __init__(
        self,
        embedding_size: int = 64,
        hidden_sizes: Sequence[int] = (64, 128, 256, 512),
        depths: Sequence[int] = (2, 2, 2, 2),
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        self.save_hyperparameters()
        config = ResNetConfig(
            num_channels=1,
            embedding_size=embedding_size,
            hidden_sizes=list(hidden_sizes),
            depths=list(depths),
            layer_type="basic",
            num_labels=10,
        )
        self.net = ResNetForImageClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(pixel_values=x).logits, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch
        logits = self.net(pixel_values=x).logits
        self.log(f"{stage}_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=stage == "val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        return torch.optim.SGD(self.parameters(), lr=h["lr"], momentum=h["momentum"], weight_decay=h["weight_decay"])
