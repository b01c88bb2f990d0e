"""The ``hf-resnet`` task of the convergence benchmark: a Hugging Face ResNet in ``self.net``, called
with keyword arguments, on the vision task's data and optimizer."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

pytest.importorskip("transformers")  # the bench extra's; not a dependency of the library

from benchmarks.convergence import TASKS  # noqa: E402
from benchmarks.convergence.hf_resnet import HFResNet  # noqa: E402


def test_hf_resnet_task_settings() -> None:
    task = TASKS["hf-resnet"]
    vision = TASKS["vision"]
    assert (task.epochs, task.limit_train_batches) == (vision.epochs, vision.limit_train_batches) == (10, 20)
    assert task.metric is vision.metric and task.evaluate_after_fit and task.tiny_description


def test_hf_resnet_full_shape_and_stem() -> None:
    """The ResNet-18 shape (11.2M parameters, BatchNorm only), and the Hugging Face stem on 32x32 images."""
    net = HFResNet().net
    config = net.config
    assert (config.num_channels, config.embedding_size, config.num_labels) == (1, 64, 10)
    assert (config.hidden_sizes, config.depths, config.layer_type) == ([64, 128, 256, 512], [2, 2, 2, 2], "basic")
    assert sum(p.numel() for p in net.parameters()) == pytest.approx(11.2e6, rel=0.01)
    norms = {type(m) for m in net.modules() if "Norm" in type(m).__name__}
    assert norms == {torch.nn.BatchNorm2d}
    with torch.no_grad():  # the 7x7 stride-2 convolution and the max-pool: 32x32 -> 8x8
        assert net.resnet.embedder(torch.zeros(2, 1, 32, 32)).shape == (2, 64, 8, 8)
        assert net(pixel_values=torch.zeros(2, 1, 32, 32)).logits.shape == (2, 10)


def test_hf_resnet_tiny_builds_and_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny task builds and a Trainer fit steps it, validating, through ``self.net(pixel_values=...)``
    only (the LightningModule's own forward is never called)."""
    torch.manual_seed(0)
    model, data = TASKS["hf-resnet"].build(0, True)
    assert isinstance(model, HFResNet) and data.size == 16 and data.batch_size == 32

    def no_forward(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the task calls self.net(pixel_values=x), never self(x)")

    monkeypatch.setattr(model, "forward", no_forward)
    before = {k: v.clone() for k, v in model.net.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 2
    after = model.net.state_dict()
    stem = "resnet.embedder.embedder.convolution.weight"
    assert not torch.equal(before[stem], after[stem])  # stepped
    assert not torch.equal(
        before["resnet.embedder.embedder.normalization.running_mean"],
        after["resnet.embedder.embedder.normalization.running_mean"],
    )  # BatchNorm statistics
    opt = trainer.optimizers[0]
    assert isinstance(opt, torch.optim.SGD)
    assert (opt.defaults["lr"], opt.defaults["momentum"], opt.defaults["weight_decay"]) == (0.05, 0.9, 5e-4)
    assert 0.0 <= float(trainer.callback_metrics["val_acc"]) <= 1.0
    test = trainer.test(model, dataloaders=data.val_dataloader(), verbose=False)[0]
    assert set(test) == {"test_loss", "test_acc"}
