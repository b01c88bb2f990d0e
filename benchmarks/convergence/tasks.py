"""The tasks the convergence benchmark trains: a model, its data, its training length and its metric."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from torch import nn

from benchmarks.convergence.runs import ACCURACY, VAL_LOSS, Metric
from benchmarks.convergence.targets import gpt_target_check, target_check


@dataclass(frozen=True)
class ConvergenceTask:
    """A model, its data and its training length, as the convergence benchmark trains it.

    Args:
        name: the task's name on the command line.
        description: one line for the tables.
        epochs: default number of epochs (``--epochs`` overrides it).
        build: ``build(seed, tiny) -> (LightningModule, LightningDataModule)``; the module logs the
            metric (and ``val_acc``/``val_loss`` where it has them); ``tiny``: a much smaller
            model/data for smoke runs (``--tiny``), where the task has one.
        metric: the figure the task is judged by (default: validation accuracy).
        limit_train_batches: default batches per epoch (``None``: the whole training set;
            ``--limit-train-batches`` overrides it).
        target: ``target(runs) -> check`` of the task's goal (default: ``target_check``).
        tiny_description: what ``--tiny`` changes, for the tables (``None``: the task has no tiny size).
        sharded_modules: the module classes ``--shard-size`` shards with FSDP2.
        self_sharded: the module shards itself in ``configure_model`` under ``--shard-size``.
        evaluate_after_fit: after the fit, validate and test on the same Trainer, and check that the
            whole model is the same on every process.

    Example:
        >>> task = TASKS["digits"]
        >>> task.epochs, task.metric.title, TASKS["gpt"].metric.higher_is_better
        (30, 'accuracy', False)
    """

    name: str
    description: str
    epochs: int
    build: Callable[[int, bool], tuple[L.LightningModule, L.LightningDataModule]]
    metric: Metric = ACCURACY
    limit_train_batches: int | None = None
    target: Callable[[list[dict[str, Any]]], dict[str, Any]] = field(default=lambda runs: target_check(runs))
    tiny_description: str | None = None
    #: module classes ``--shard-size`` shards (``sharded_modules``); empty: the task cannot be sharded
    sharded_modules: tuple[str, ...] = ()
    self_sharded: bool = False
    evaluate_after_fit: bool = False


def _digits(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    from lightning_sparse.demos import DigitsClassifier, DigitsDataModule

    return DigitsClassifier(), DigitsDataModule(batch_size=32, seed=0)


def _text(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    from lightning_sparse.demos import NextCharClassifier, TextDataModule

    return NextCharClassifier(), TextDataModule(batch_size=64, seed=0)


def _vision(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    from lightning_sparse.demos import DigitImagesDataModule, ResNetClassifier

    if tiny:
        return ResNetClassifier(width=4, blocks=(1, 1)), DigitImagesDataModule(batch_size=32, size=16, seed=0)
    return ResNetClassifier(), DigitImagesDataModule(batch_size=32, seed=0)


class SubmoduleVision(L.LightningModule):
    """The vision task's model written the way most LightningModules are: the network a plain
    ``nn.Module`` in ``self.net``, called as ``self.net(x)`` in ``training_step`` (never ``self(x)``).
    Built from a ``ResNetClassifier``'s layers, so it starts from the same weights.

    Example:
        >>> from lightning_sparse.demos import ResNetClassifier
        >>> model = SubmoduleVision(ResNetClassifier(width=4, blocks=(1, 1)))
        >>> model.net(torch.zeros(2, 1, 16, 16)).shape
        torch.Size([2, 10])
    """

    def __init__(self, resnet: L.LightningModule) -> None:
        super().__init__()
        self.hparams.update(resnet.hparams)
        layers = [resnet.stem, resnet.body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), resnet.head]
        self.net = nn.Sequential(*layers)  # type: ignore[arg-type]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        return torch.optim.SGD(self.parameters(), lr=h["lr"], momentum=h["momentum"], weight_decay=h["weight_decay"])


def _vision_submodule(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    resnet, data = _vision(seed, tiny)
    return SubmoduleVision(resnet), data


#: the gpt task's context (characters): 64 costs ~3x the step time of 32 on one CPU thread
GPT_CONTEXT = 32


def _gpt(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    from lightning_sparse.demos import GPTDataModule, TinyGPT

    if tiny:
        return TinyGPT(context=16, width=32, layers=1, heads=2), GPTDataModule(16, context=16, n_train=4096, n_val=64)
    return TinyGPT(context=GPT_CONTEXT), GPTDataModule(batch_size=16, context=GPT_CONTEXT, n_val=1024, seed=0)


#: the hf-gpt tasks' context (characters): 128 cost ~6 s a step on 4 processes on 2 CPU cores, 32 ~1 s
HF_GPT_CONTEXT = 32


def _hf_gpt(
    seed: int, tiny: bool = False, self_sharded: bool = False
) -> tuple[L.LightningModule, L.LightningDataModule]:
    from benchmarks.convergence.hf_gpt import HFGPT
    from lightning_sparse.demos import GPTDataModule

    if tiny:
        model = HFGPT(context=16, width=32, layers=1, heads=2, self_sharded=self_sharded)
        return model, GPTDataModule(16, context=16, n_train=4096, n_val=64)
    model = HFGPT(context=HF_GPT_CONTEXT, self_sharded=self_sharded)
    return model, GPTDataModule(batch_size=16, context=HF_GPT_CONTEXT, n_val=1024, seed=0)


def _hf_gpt_own(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    return _hf_gpt(seed, tiny, self_sharded=True)


def _hf_resnet(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    from benchmarks.convergence.hf_resnet import HFResNet
    from lightning_sparse.demos import DigitImagesDataModule

    if tiny:
        model = HFResNet(embedding_size=4, hidden_sizes=(4, 8), depths=(1, 1))
        return model, DigitImagesDataModule(batch_size=32, size=16, seed=0)
    return HFResNet(), DigitImagesDataModule(batch_size=32, seed=0)


def _gpt_target(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return gpt_target_check(runs)


TASKS: dict[str, ConvergenceTask] = {
    "digits": ConvergenceTask(
        "digits",
        "MLP 64-512-256-10 on scikit-learn's 8x8 digits (1,438 train / 359 validation images), "
        "batch 32 per process, SGD lr 0.05 momentum 0.9",
        epochs=30,
        build=_digits,
    ),
    "text": ConvergenceTask(
        "text",
        "GRU next-character prediction on Python standard-library source (embedding 97x64, GRU 128, "
        "context 16; 32,768 train / 8,192 validation windows), batch 64 per process, SGD lr 0.2 momentum 0.9 "
        "annealed to 0 (cosine), gradient norm clipped at 1",
        epochs=5,
        build=_text,
    ),
    "vision": ConvergenceTask(
        "vision",
        "ResNet-18 (CIFAR-style, BatchNorm; 11.2M parameters) on scikit-learn's digits upsampled to 32x32 "
        "(1,438 train / 359 validation images), batch 32 per process, 20 batches per epoch, SGD lr 0.05 "
        "momentum 0.9 weight decay 5e-4",
        epochs=10,
        build=_vision,
        limit_train_batches=20,
        tiny_description="--tiny: width 4, one block in each of two stages, 16x16 images",
    ),
    "vision_submodule": ConvergenceTask(
        "vision_submodule",
        "the vision task with the ResNet-18 a submodule that training_step calls (self.net(x)), as most "
        "LightningModules are written",
        epochs=10,
        build=_vision_submodule,
        limit_train_batches=20,
        tiny_description="--tiny: width 4, one block in each of two stages, 16x16 images",
    ),
    "hf-resnet": ConvergenceTask(
        "hf-resnet",
        "Hugging Face ResNetForImageClassification (ResNet-18 shape: embedding 64, stages 64-128-256-512 of 2 "
        "basic blocks, BatchNorm, 1 channel; its 7x7 stride-2 stem and max-pool take 32x32 to 8x8; 11.2M "
        "parameters) held in self.net and called as self.net(pixel_values=x).logits, on the vision task's data "
        "and optimizer; validated and tested on the same Trainer after the fit",
        epochs=10,
        build=_hf_resnet,
        limit_train_batches=20,
        tiny_description="--tiny: embedding 4, stages 4-8 of one block each, 16x16 images",
        evaluate_after_fit=True,
    ),
    "gpt": ConvergenceTask(
        "gpt",
        f"GPT (4 pre-LayerNorm blocks, width 256, 4 heads, context {GPT_CONTEXT}, tied embeddings; "
        "3.2M parameters) predicting the next character of Python standard-library source (32,768 train "
        "windows drawn with the seed, 1,024 validation windows of other modules), batch 16 per process, "
        "100 batches per epoch, AdamW lr 1e-3 betas (0.9, 0.95) weight decay 0.01 on matrices, 10% linear "
        "warm-up then cosine to 1e-4, gradient norm clipped at 1",
        epochs=6,
        build=_gpt,
        metric=VAL_LOSS,
        limit_train_batches=100,
        target=_gpt_target,
        tiny_description="--tiny: width 32, 1 block, 2 heads, context 16, 4,096 train / 64 validation windows",
        sharded_modules=("_Block",),
    ),
    "hf-gpt": ConvergenceTask(
        "hf-gpt",
        f"Hugging Face GPT2LMHeadModel (4 blocks, width 256, 4 heads, context {HF_GPT_CONTEXT}, tied embeddings, "
        "97-character vocabulary; 3.2M parameters) held in self.model and called as self.model(input_ids=x, "
        "labels=x).loss, on the gpt task's data and optimizer; validated and tested on the same Trainer after "
        "the fit",
        epochs=6,
        build=_hf_gpt,
        metric=VAL_LOSS,
        limit_train_batches=100,
        target=_gpt_target,
        tiny_description="--tiny: width 32, 1 block, 2 heads, context 16, 4,096 train / 64 validation windows",
        sharded_modules=("GPT2Block",),
        evaluate_after_fit=True,
    ),
    "hf-gpt-own": ConvergenceTask(
        "hf-gpt-own",
        "the hf-gpt task, its configure_model calling fully_shard itself (each GPT2Block, then self.model)",
        epochs=6,
        build=_hf_gpt_own,
        metric=VAL_LOSS,
        limit_train_batches=100,
        target=_gpt_target,
        tiny_description="--tiny: width 32, 1 block, 2 heads, context 16, 4,096 train / 64 validation windows",
        self_sharded=True,
        evaluate_after_fit=True,
    ),
}


def _metric_of(task: str, metric: Metric | None) -> Metric:
    if metric is not None:
        return metric
    return TASKS[task].metric if task in TASKS else ACCURACY
