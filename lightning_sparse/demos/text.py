"""The text task: next-character prediction on the running Python's standard-library source (no download)."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_sparse.demos._common import _Classifier, _DataModule, _NormClipping

#: Standard-library modules whose source the text task trains on (present in Python 3.10-3.13).
TEXT_TRAIN_FILES: tuple[str, ...] = (
    "argparse.py",
    "dataclasses.py",
    "difflib.py",
    "fractions.py",
    "heapq.py",
    "pprint.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
    "json/decoder.py",
    "json/encoder.py",
)
#: Standard-library modules whose source the text task validates on (never seen in training).
TEXT_VAL_FILES: tuple[str, ...] = ("calendar.py", "functools.py", "csv.py")

#: Characters of the text task's vocabulary: newline and printable ASCII; anything else is one extra class.
TEXT_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
TEXT_VOCAB = len(TEXT_CHARS) + 1  # + "other" (tabs, non-ASCII)


def stdlib_source(files: Sequence[str], stdlib: str | None = None) -> str:
    """The concatenated source of the standard-library ``files`` this Python ships (FileNotFoundError: none)."""
    root = stdlib or sysconfig.get_paths()["stdlib"]
    paths = [Path(root, name) for name in files]
    parts = [path.read_text(encoding="utf-8") for path in paths if path.is_file()]
    if not parts:
        raise FileNotFoundError(f"none of {list(files)} found under the standard library directory {root!r}")
    return "\n".join(parts)


def encode_text(text: str) -> Tensor:
    """Characters -> class indices (``TEXT_CHARS`` positions; anything else -> ``TEXT_VOCAB - 1``), int64."""
    table = {c: i for i, c in enumerate(TEXT_CHARS)}
    return torch.tensor([table.get(c, TEXT_VOCAB - 1) for c in text], dtype=torch.long)


def char_windows(codes: Tensor, positions: Tensor, context: int) -> TensorDataset:
    """(the ``context`` characters before each position, the character at it) as a TensorDataset."""
    offsets = torch.arange(-context, 0)
    return TensorDataset(codes[positions[:, None] + offsets], codes[positions])


def load_text_tensors(
    context: int = 16, n_train: int = 32768, n_val: int = 8192, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Next-character windows of standard-library source as (train, val) TensorDatasets: ``n_train`` positions
    of ``TEXT_TRAIN_FILES`` drawn with ``seed``, ``n_val`` evenly spaced ones of ``TEXT_VAL_FILES``.

    Example:
        >>> train, val = load_text_tensors(context=16, n_train=1000, n_val=200)
        >>> train.tensors[0].shape, val.tensors[1].shape
        (torch.Size([1000, 16]), torch.Size([200]))
    """
    train, val, train_start, val_start = _window_starts(context, n_train, n_val, seed)
    return char_windows(train, context + train_start, context), char_windows(val, context + val_start, context)


def _window_starts(context: int, n_train: int, n_val: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The train and validation codes, and the starts of ``n_train`` windows of ``context`` characters and the
    one after, distinct and drawn with ``seed``, and of ``n_val`` evenly spaced ones."""
    train_codes = encode_text(stdlib_source(TEXT_TRAIN_FILES))
    val_codes = encode_text(stdlib_source(TEXT_VAL_FILES))
    n_pos, n_val_pos = len(train_codes) - context, len(val_codes) - context
    if not 0 < n_train <= n_pos or not 0 < n_val <= n_val_pos:
        raise ValueError(
            f"n_train={n_train}, n_val={n_val} is not allowed: expected 1..{n_pos} training and "
            f"1..{n_val_pos} validation windows of context {context}"
        )
    gen = torch.Generator().manual_seed(seed)
    train_start = torch.randperm(n_pos, generator=gen)[:n_train]
    return train_codes, val_codes, train_start, torch.linspace(0, n_val_pos - 1, n_val).long()


class _WindowDataModule(_DataModule):
    """Windows of standard-library source drawn with a seed (``loader``)."""

    val_batch_size = 1024
    #: ``loader(context, n_train, n_val, seed) -> (train, validation)``: the task's windows
    loader: Callable[[int, int, int, int], tuple[TensorDataset, TensorDataset]]

    def __init__(self, batch_size: int, context: int, n_train: int, n_val: int, seed: int) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is not allowed: expected an integer >= 1")
        self.batch_size = batch_size
        self.context = context
        self.n_train = n_train
        self.n_val = n_val
        self.seed = seed

    def load(self) -> tuple[TensorDataset, TensorDataset]:
        return type(self).loader(self.context, self.n_train, self.n_val, self.seed)


class TextDataModule(_WindowDataModule):
    """Next-character prediction on Python standard-library source.

    Args:
        batch_size: per-process batch size.
        context: characters the model sees before the one it predicts.
        n_train: training windows (distinct positions, drawn with ``seed``).
        n_val: validation windows, from modules not used for training.
        seed: seed of the training positions.

    Example:
        >>> dm = TextDataModule(batch_size=64, n_train=2048, n_val=512)
        >>> dm.setup()
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> x.shape, y.shape
        (torch.Size([64, 16]), torch.Size([64]))
    """

    def __init__(
        self, batch_size: int = 64, context: int = 16, n_train: int = 32768, n_val: int = 8192, seed: int = 0
    ) -> None:
        super().__init__(batch_size, context, n_train, n_val, seed)

    loader = staticmethod(load_text_tensors)


class NextCharClassifier(_NormClipping, _Classifier):
    """Embedding + GRU over a window of characters, predicting the next one; SGD + momentum.

    Args:
        embed_dim: width of the character embedding.
        hidden: GRU hidden size.
        lr: learning rate.
        momentum: SGD momentum.
        clip: gradient-norm clipping threshold (``None``: no clipping).
        cosine: anneal the learning rate to 0 over the fit's optimizer steps (cosine), else keep it constant.

    Example:
        >>> model = NextCharClassifier(hidden=64)
        >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 97])
    """

    def __init__(
        self,
        embed_dim: int = 64,
        hidden: int = 128,
        lr: float = 0.2,
        momentum: float = 0.9,
        clip: float | None = 1.0,
        cosine: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(TEXT_VOCAB, embed_dim)
        self.rnn = nn.GRU(embed_dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, TEXT_VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        _, h = self.rnn(self.embed(x))
        return self.head(h[-1])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"])
        if not self.hparams["cosine"]:
            return opt
        steps = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
