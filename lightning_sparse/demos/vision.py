"""The vision task: a CIFAR-style ResNet-18 with BatchNorm on the scikit-learn digits upsampled to 32x32."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_sparse.demos._common import _Classifier
from lightning_sparse.demos.digits import DigitsDataModule, load_digits_tensors


def load_digit_images(size: int = 32, test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The scikit-learn digits as (train, test) TensorDatasets of ``1 x size x size`` images in [0, 1]."""
    train, test = (d.tensors for d in load_digits_tensors(test_fraction, seed))

    def images(x: Tensor) -> Tensor:
        return nn.functional.interpolate(x.view(-1, 1, 8, 8), size=(size, size), mode="bilinear", align_corners=False)

    return TensorDataset(images(train[0]), train[1]), TensorDataset(images(test[0]), test[1])


class DigitImagesDataModule(DigitsDataModule):
    """The digits as ``size x size`` images (upsampled from scikit-learn's 8x8), split train/test.

    Args:
        batch_size: per-process batch size.
        size: side of the images.
        test_fraction: share of the images held out for validation.
        seed: seed of the split.

    Example:
        >>> dm = DigitImagesDataModule(batch_size=32)
    """

    def __init__(self, batch_size: int = 32, size: int = 32, test_fraction: float = 0.2, seed: int = 0) -> None:
        super().__init__(batch_size, test_fraction, seed)
        self.size = size

    def load(self) -> tuple[TensorDataset, TensorDataset]:
        return load_digit_images(self.size, self.test_fraction, self.seed)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNetClassifier(_Classifier):
    """A CIFAR-style ResNet-18 with BatchNorm for 1-channel images; SGD + momentum and weight decay.

    Args:
        width: channels of the first stage (64: ResNet-18; the stages double it).
        blocks: basic blocks per stage.
        lr: learning rate.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.

    Example:
        >>> model = ResNetClassifier(width=8)
        >>> model(torch.zeros(2, 1, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        width: int = 64,
        blocks: tuple[int, ...] = (2, 2, 2, 2),
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers: list[nn.Module] = []
        cin = width
        for stage, n in enumerate(blocks):
            cout = width * 2**stage
            for i in range(n):
                layers.append(_BasicBlock(cin, cout, 2 if (i == 0 and stage > 0) else 1))
                cin = cout
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(cin, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        return torch.optim.SGD(self.parameters(), lr=h["lr"], momentum=h["momentum"], weight_decay=h["weight_decay"])
