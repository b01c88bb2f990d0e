"""A Hugging Face ``GPT2LMHeadModel`` held in ``self.model`` and called with keyword arguments, the way
Hugging Face models are trained with Lightning: the ``hf-gpt`` tasks of the convergence benchmark.

Needs the ``transformers`` package (the ``bench`` extra; not a dependency of the library).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor

from lightning_sparse.demos._common import _NormClipping
from lightning_sparse.demos.gpt import warmup_cosine
from lightning_sparse.demos.text import TEXT_VOCAB


class HFGPT(_NormClipping, L.LightningModule):
    """``GPT2LMHeadModel`` (tied input/output embeddings) in ``self.model``; every step calls
    ``self.model(input_ids=x, labels=x).loss`` and never ``self(...)``. ``self_sharded``: the
    module's ``configure_model`` shards it with ``fully_shard`` itself (each ``GPT2Block``, then
    ``self.model``, as Lightning's FSDP2 examples do) where the strategy has a ``"shard"`` mesh.
    AdamW lr 1e-3 betas (0.9, 0.95), weight decay 0.01 on matrices, 10% linear warm-up then cosine to
    1e-4, gradient norm clipped at 1 (as the ``gpt`` task's TinyGPT).

    Example:
        >>> model = HFGPT(context=16, width=32, layers=1, heads=2)
        >>> model.model.lm_head.weight is model.model.transformer.wte.weight
        True
        >>> model.training_step((torch.zeros(2, 16, dtype=torch.long),) * 2, 0).shape
        torch.Size([])
    """

    def __init__(
        self,
        context: int = 128,
        width: int = 256,
        layers: int = 4,
        heads: int = 4,
        vocab: int = TEXT_VOCAB,
        self_sharded: bool = False,
        lr: float = 1e-3,
        clip: float | None = 1.0,
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=vocab,
            n_positions=context,
            n_embd=width,
            n_layer=layers,
            n_head=heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=None,
        )
        self.model = GPT2LMHeadModel(config)

    def configure_model(self) -> None:
        if not self.hparams["self_sharded"]:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = self.device_mesh
        if mesh is None or "shard" not in (mesh.mesh_dim_names or ()) or isinstance(self.model, FSDPModule):
            return  # not sharded (dense DDP), or sharded in an earlier stage
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(self.model, mesh=mesh["shard"])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, _ = batch
        return self.model(input_ids=x, labels=x).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self.log("val_loss", self.model(input_ids=x, labels=x).loss, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self.log("test_loss", self.model(input_ids=x, labels=x).loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.01}, {"params": others, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=self.hparams["lr"], betas=(0.9, 0.95))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
