"""A small GPT: next-character language modelling on the text task's standard-library source."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_sparse.demos._common import _Classifier, _NormClipping
from lightning_sparse.demos.text import TEXT_VOCAB, _window_starts, _WindowDataModule


def load_gpt_tensors(
    context: int = 64, n_train: int = 32768, n_val: int = 1024, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Language-modelling windows of standard-library source as (train, val) TensorDatasets: inputs the first
    ``context`` of ``context + 1`` characters, targets the last ``context`` (int64 ``(n, context)``).

    Example:
        >>> train, val = load_gpt_tensors(context=32, n_train=1000, n_val=200)
        >>> train.tensors[0].shape, val.tensors[1].shape
        (torch.Size([1000, 32]), torch.Size([200, 32]))
    """
    if context < 1:
        raise ValueError(f"context={context} is not allowed: expected an integer >= 1")
    train_codes, val_codes, train_start, val_start = _window_starts(context, n_train, n_val, seed)
    offsets = torch.arange(context + 1)
    train = train_codes[train_start[:, None] + offsets]
    val = val_codes[val_start[:, None] + offsets]
    return TensorDataset(train[:, :-1], train[:, 1:]), TensorDataset(val[:, :-1], val[:, 1:])


class GPTDataModule(_WindowDataModule):
    """Next-character language modelling on Python standard-library source, for ``TinyGPT``: ``y`` is ``x``
    shifted by one. Keep ``n_val`` a multiple of the number of processes (no window counted twice).

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
    loader = staticmethod(load_gpt_tensors)

    def __init__(
        self, batch_size: int = 16, context: int = 64, n_train: int = 32768, n_val: int = 1024, seed: int = 0
    ) -> None:
        super().__init__(batch_size, context, n_train, n_val, seed)


def warmup_cosine(step: int, total: int, warmup_fraction: float = 0.1, final_fraction: float = 0.1) -> float:
    """Learning-rate factor at optimizer step ``step`` (0-based) of ``total``: a linear warm-up to 1 over
    ``warmup_fraction`` of the steps (at least one), then a half cosine down to ``final_fraction``.

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


class TinyGPT(_NormClipping, _Classifier):
    """A small GPT (pre-LayerNorm, causal self-attention, GELU MLP) for next-character prediction; AdamW.

    The output layer is tied to the token embedding; weight decay applies to the matrices only; the
    learning rate follows :func:`warmup_cosine` per optimizer step.

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
        clip: gradient-norm clipping threshold (``None``: no clipping).

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
        context = self.hparams["context"]
        if t > context:
            raise ValueError(f"input length {t} is not allowed: expected at most context={context}")
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks:
            h = block(h)
        return nn.functional.linear(self.ln_f(h), self.tok.weight)  # output layer tied to the embedding

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": hp["weight_decay"]}, {"params": others, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=hp["lr"], betas=tuple(hp["betas"]))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine(step, total, hp["warmup_fraction"], hp["final_lr_fraction"])
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
