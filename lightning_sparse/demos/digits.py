"""The digits task: an MLP on the 8x8 handwritten digits that scikit-learn ships (nothing is downloaded)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_sparse.demos._common import _Classifier, _DataModule


def load_digits_tensors(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The scikit-learn digits as (train, test) TensorDatasets, features scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the digits task needs scikit-learn, which ships the data set: pip install 'lightning_sparse[examples]'"
        ) from err
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(x)))
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


class DigitsDataModule(_DataModule):
    """Handwritten digits (1,797 8x8 images shipped with scikit-learn), split train/test.

    Args:
        batch_size: per-process batch size.
        test_fraction: share of the images held out for validation.
        seed: seed of the split.

    Example:
        >>> dm = DigitsDataModule(batch_size=32)
    """

    def __init__(self, batch_size: int = 32, test_fraction: float = 0.2, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.test_fraction = test_fraction
        self.seed = seed

    def load(self) -> tuple[TensorDataset, TensorDataset]:
        return load_digits_tensors(self.test_fraction, self.seed)


class DigitsClassifier(_Classifier):
    """An MLP for the 8x8 digits (64 -> hidden... -> 10), trained with SGD + momentum.

    Args:
        hidden: widths of the hidden layers.
        lr: learning rate.
        momentum: SGD momentum.

    Example:
        >>> model = DigitsClassifier(hidden=(128,))
        >>> model(torch.zeros(2, 64)).shape
        torch.Size([2, 10])
    """

    def __init__(self, hidden: tuple[int, ...] = (512, 256), lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = 64
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 10))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"])


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    """Classification accuracy of ``model`` on a (features, labels) TensorDataset."""
    x, y = dataset.tensors
    was_training = model.training
    model.eval()
    acc = (model(x).argmax(1) == y).float().mean().item()
    model.train(was_training)
    return acc
