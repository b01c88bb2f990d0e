"""Small, download-free training tasks used by the examples, the CLI configs and the benchmarks.

The digits task uses the 8x8 handwritten digits that scikit-learn ships inside its wheel
(``pip install "lightning_sparse[examples]"``), so nothing is fetched at run time.

The text task predicts the next character of Python source code, read from the ``.py`` files of
the Python standard library that runs it (``sysconfig.get_paths()["stdlib"]``): no extra package,
no download. Its data depend on the Python version (the standard library changes between
versions) and, given that and the seed, on nothing else.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


def load_digits_tensors(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The scikit-learn digits as (train, test) TensorDatasets, features scaled to [0, 1].

    Example:
        >>> train, test = load_digits_tensors()  # doctest: +SKIP
        >>> len(train), len(test)  # doctest: +SKIP
        (1438, 359)
    """
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


class DigitsDataModule(L.LightningDataModule):
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
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = load_digits_tensors(self.test_fraction, self.seed)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=256)


class _Classifier(L.LightningModule):
    """Cross-entropy training and validation (``val_loss``, ``val_acc``) shared by the example tasks."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)


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
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    """Classification accuracy of ``model`` on a (features, labels) TensorDataset."""
    x, y = dataset.tensors
    was_training = model.training
    model.eval()
    acc = (model(x).argmax(1) == y).float().mean().item()
    model.train(was_training)
    return acc


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
    """The concatenated source of standard-library files, given by path relative to the stdlib directory.

    Files that this Python does not ship are skipped; if none is found, ``FileNotFoundError``.

    Example:
        >>> text = stdlib_source(["textwrap.py"])
        >>> "def wrap(" in text
        True
    """
    root = stdlib or sysconfig.get_paths()["stdlib"]
    parts = []
    for name in files:
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                parts.append(f.read())
    if not parts:
        raise FileNotFoundError(f"none of {list(files)} found under the standard library directory {root!r}")
    return "\n".join(parts)


def encode_text(text: str) -> Tensor:
    """Characters -> class indices (``TEXT_CHARS`` positions; anything else -> ``TEXT_VOCAB - 1``), int64.

    Example:
        >>> encode_text("a\\n\\t").tolist()
        [66, 0, 96]
    """
    table = {c: i for i, c in enumerate(TEXT_CHARS)}
    other = TEXT_VOCAB - 1
    return torch.tensor([table.get(c, other) for c in text], dtype=torch.long)


def char_windows(codes: Tensor, positions: Tensor, context: int) -> TensorDataset:
    """(the ``context`` characters before each position, the character at it) as a TensorDataset."""
    offsets = torch.arange(-context, 0)
    return TensorDataset(codes[positions[:, None] + offsets], codes[positions])


def load_text_tensors(
    context: int = 16, n_train: int = 32768, n_val: int = 8192, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Next-character windows of standard-library source as (train, val) TensorDatasets.

    Training windows are ``n_train`` distinct positions of the ``TEXT_TRAIN_FILES`` source drawn with
    ``seed``; validation windows are ``n_val`` evenly spaced positions of the ``TEXT_VAL_FILES`` source.
    Inputs are int64 ``(n, context)`` character classes, targets int64 ``(n,)``.

    Example:
        >>> train, val = load_text_tensors(context=16, n_train=1000, n_val=200)
        >>> train.tensors[0].shape, val.tensors[1].shape
        (torch.Size([1000, 16]), torch.Size([200]))
    """
    train_codes = encode_text(stdlib_source(TEXT_TRAIN_FILES))
    val_codes = encode_text(stdlib_source(TEXT_VAL_FILES))
    n_pos = len(train_codes) - context
    if not 0 < n_train <= n_pos or not 0 < n_val <= len(val_codes) - context:
        raise ValueError(
            f"n_train={n_train}, n_val={n_val} is not allowed: expected 1..{n_pos} training and "
            f"1..{len(val_codes) - context} validation windows of context {context}"
        )
    gen = torch.Generator().manual_seed(seed)
    train_pos = context + torch.randperm(n_pos, generator=gen)[:n_train]
    val_pos = context + torch.linspace(0, len(val_codes) - context - 1, n_val).long()
    return char_windows(train_codes, train_pos, context), char_windows(val_codes, val_pos, context)


class _WindowDataModule(L.LightningDataModule):
    """Windows of standard-library source drawn with a seed (``loader``), shuffled for training."""

    #: validation batch size
    val_batch_size = 1024

    def __init__(self, batch_size: int, context: int, n_train: int, n_val: int, seed: int) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is not allowed: expected an integer >= 1")
        self.batch_size = batch_size
        self.context = context
        self.n_train = n_train
        self.n_val = n_val
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    #: ``loader(context, n_train, n_val, seed) -> (train, validation)``: the task's windows
    loader: Callable[[int, int, int, int], tuple[TensorDataset, TensorDataset]]

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = type(self).loader(self.context, self.n_train, self.n_val, self.seed)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.val_batch_size)


class TextDataModule(_WindowDataModule):
    """Next-character prediction on Python standard-library source (no download, no extra package).

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

    val_batch_size = 1024

    def __init__(
        self, batch_size: int = 64, context: int = 16, n_train: int = 32768, n_val: int = 8192, seed: int = 0
    ) -> None:
        super().__init__(batch_size, context, n_train, n_val, seed)

    loader = staticmethod(load_text_tensors)


class _NormClipping:
    """Gradient-norm clipping at the module's ``clip`` hyperparameter (``None``: none); the Trainer's
    ``gradient_clip_val`` overrides it."""

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Any = None,
    ) -> None:
        clip = self.hparams.clip if gradient_clip_val is None else gradient_clip_val
        if clip is not None:
            self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")


class NextCharClassifier(_NormClipping, _Classifier):
    """Embedding + GRU over a window of characters, predicting the next one; SGD + momentum.

    With the defaults every weight tensor (embedding 97x64, GRU 384x64 and 384x128, head 97x128; 93,376
    weights) has more than 1,024 elements, so ``SparseDDPStrategy`` sends all of them sparse and only the
    biases (865 elements) dense.

    Args:
        embed_dim: width of the character embedding.
        hidden: GRU hidden size.
        lr: learning rate (0.2: the best of 0.1, 0.2 and 0.5 for dense DDP over 5 epochs on 2 processes
            with batch 64, validation accuracy 0.516 / 0.535 / 0.522).
        momentum: SGD momentum.
        clip: gradient-norm clipping threshold (``None``: no clipping); the Trainer's
            ``gradient_clip_val`` overrides it.
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
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
        if not self.hparams.cosine:
            return opt
        steps = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ----------------------------------------------------------------------------------------------
# a small GPT: next-character language modelling on the same standard-library source


def load_gpt_tensors(
    context: int = 64, n_train: int = 32768, n_val: int = 1024, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Language-modelling windows of standard-library source as (train, val) TensorDatasets.

    A window is ``context + 1`` consecutive characters (``encode_text`` classes); the input is its
    first ``context`` characters and the target its last ``context`` (the input shifted by one), so
    every position of a window is a next-character prediction. Training windows start at ``n_train``
    distinct positions of the ``TEXT_TRAIN_FILES`` source drawn with ``seed``; validation windows
    at ``n_val`` evenly spaced positions of the ``TEXT_VAL_FILES`` source (modules never trained on).
    Inputs and targets are int64 ``(n, context)``.

    Example:
        >>> train, val = load_gpt_tensors(context=32, n_train=1000, n_val=200)
        >>> train.tensors[0].shape, val.tensors[1].shape
        (torch.Size([1000, 32]), torch.Size([200, 32]))
    """
    if context < 1:
        raise ValueError(f"context={context} is not allowed: expected an integer >= 1")
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
    val_start = torch.linspace(0, n_val_pos - 1, n_val).long()
    offsets = torch.arange(context + 1)
    train = train_codes[train_start[:, None] + offsets]
    val = val_codes[val_start[:, None] + offsets]
    return TensorDataset(train[:, :-1], train[:, 1:]), TensorDataset(val[:, :-1], val[:, 1:])


class GPTDataModule(_WindowDataModule):
    """Next-character language modelling on Python standard-library source, for ``TinyGPT``.

    Batches are ``(x, y)`` int64 ``(batch, context)``: ``y`` is ``x`` shifted by one character.
    With several processes Lightning's distributed sampler splits the windows between them; keep
    ``n_val`` a multiple of the number of processes so that no validation window is counted twice.

    Args:
        batch_size: per-process batch size (windows).
        context: characters per window (the model's context length).
        n_train: training windows (distinct start positions, drawn with ``seed``).
        n_val: validation windows, evenly spaced over modules not used for training.
        seed: seed of the training positions.

    Example:
        >>> dm = GPTDataModule(batch_size=4, context=32, n_train=256, n_val=64)
        >>> dm.setup()
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([4, 32]), True)
    """

    val_batch_size = 128

    def __init__(
        self, batch_size: int = 16, context: int = 64, n_train: int = 32768, n_val: int = 1024, seed: int = 0
    ) -> None:
        super().__init__(batch_size, context, n_train, n_val, seed)

    loader = staticmethod(load_gpt_tensors)


def warmup_cosine(step: int, total: int, warmup_fraction: float = 0.1, final_fraction: float = 0.1) -> float:
    """Learning-rate factor at optimizer step ``step`` (0-based) of ``total``: linear warm-up, then cosine.

    The factor rises linearly to 1 over the first ``warmup_fraction`` of the steps (at least one
    step), then follows a half cosine down to ``final_fraction`` at step ``total``.

    Example:
        >>> [round(warmup_cosine(s, 100), 3) for s in (0, 9, 10, 55, 100)]
        [0.1, 1.0, 1.0, 0.55, 0.1]
    """
    warmup = max(1, int(round(warmup_fraction * total)))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal multi-head self-attention, then a GELU MLP (4x width)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(_NormClipping, L.LightningModule):
    """A small GPT (pre-LayerNorm, causal self-attention, GELU MLP) for next-character prediction; AdamW.

    Token and learned position embeddings, ``layers`` blocks, a final LayerNorm and an output layer
    tied to the token embedding (one shared ``vocab x width`` matrix). AdamW with weight decay on the
    matrices only (not on biases and LayerNorm gains); the learning rate warms up linearly over the
    first ``warmup_fraction`` of the optimizer steps, then follows a cosine down to ``final_lr_fraction``
    of ``lr`` at the end of the fit (``warmup_cosine``, stepped every optimizer step, total from
    ``trainer.estimated_stepping_batches``). Logs ``train_loss``, ``val_loss`` (mean cross-entropy in
    nats over every validation token) and ``val_acc`` (next-character accuracy over them).

    With the defaults: 3,200,768 parameters (4 blocks of 789,760; embeddings 97x256 and 64x256).

    Args:
        vocab: number of character classes.
        context: longest input (positions of the learned position embedding).
        width: model width (embedding size).
        layers: transformer blocks.
        heads: attention heads (must divide ``width``).
        lr: peak learning rate.
        weight_decay: AdamW weight decay of the matrices.
        betas: AdamW betas.
        warmup_fraction: share of the optimizer steps spent warming up.
        final_lr_fraction: learning rate at the end, as a fraction of ``lr``.
        clip: gradient-norm clipping threshold (``None``: no clipping); the Trainer's
            ``gradient_clip_val`` overrides it.

    Example:
        >>> model = TinyGPT(width=32, layers=1, heads=2, context=16)
        >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 97])
    """

    def __init__(
        self,
        vocab: int = TEXT_VOCAB,
        context: int = 64,
        width: int = 256,
        layers: int = 4,
        heads: int = 4,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_fraction: float = 0.1,
        final_lr_fraction: float = 0.1,
        clip: float | None = 1.0,
    ) -> None:
        super().__init__()
        for name, value in (("vocab", vocab), ("context", context), ("width", width), ("layers", layers)):
            if value < 1:
                raise ValueError(f"{name}={value} is not allowed: expected an integer >= 1")
        if heads < 1 or width % heads:
            raise ValueError(f"heads={heads} is not allowed: expected a positive divisor of width={width}")
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        # GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(batch, t, vocab)`` of the character after each position of ``x`` ``(batch, t)``."""
        t = x.shape[1]
        if t > self.hparams.context:
            raise ValueError(f"input length {t} is not allowed: expected at most context={self.hparams.context}")
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks:
            h = block(h)
        return nn.functional.linear(self.ln_f(h), self.tok.weight)  # output layer tied to the embedding

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x).flatten(0, 1)
        # every window has the same number of tokens, so the batch-size-weighted mean over batches
        # (and the mean over processes) is the mean over all validation tokens
        self.log("val_loss", nn.functional.cross_entropy(logits, y.flatten()), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y.flatten()).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": hp.weight_decay}, {"params": others, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine(step, total, hp.warmup_fraction, hp.final_lr_fraction)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
