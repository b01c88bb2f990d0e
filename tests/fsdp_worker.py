"""A Trainer fit with ``sparse_fsdp`` (or FSDP2 / DDP baselines) on a small model of blocks, launched by
tests/test_fsdp_trainer.py through Lightning's popen launcher:

    python fsdp_worker.py config.json

Each rank saves what the test checks to ``[name_]rank{r}.pt``: its local shards of the global model
after the fit (and their checksum), the losses, the telemetry, the mesh coordinates and, with
``validate``, the validation loss.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NamedTuple

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_sparse
from lightning_sparse import end_process_group

WIDTH = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Blocks(L.LightningModule):
    def __init__(self, lr: float = 0.03, self_sharded: bool = False, nan_at: tuple[int, int] = (-1, -1)) -> None:
        super().__init__()
        self.nan_at = tuple(nan_at)  # (step, rank): that rank's loss times NaN at that step
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.out = nn.Linear(WIDTH, 1)
        self.lr = lr
        self.self_sharded = self_sharded
        self.losses: list[float] = []
        self.batches: list[float] = []

    def configure_model(self) -> None:
        if not self.self_sharded:
            return
        from torch.distributed.fsdp import fully_shard

        names = self.device_mesh.mesh_dim_names or ()
        mesh = self.device_mesh["shard" if "shard" in names else "data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        for module in (self.inp, self.blocks, self.out):
            fully_shard(module, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x))).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = (self(x) - y).pow(2).mean()
        if (self.global_step, self.global_rank) == self.nan_at:
            loss = loss * float("nan")  # reaches AdamW's moments: every later update of this rank is NaN
        self.losses.append(float(loss.detach()))
        self.batches.append(float(x.sum()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", (self(x) - y).pow(2).mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


VOCAB, CONTEXT = 64, 16


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.ln(h)))


class LMOutput(NamedTuple):
    """What a Hugging Face causal LM returns, as far as the tests need it (a NamedTuple: FSDP2 finds the
    tensors of a module's output to run its backward hooks on; Hugging Face's ModelOutput is a pytree too)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class TiedGPT(nn.Module):
    """A small GPT with tied input/output embeddings, called like a Hugging Face GPT2LMHeadModel."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.h = nn.ModuleList([GPTBlock() for _ in range(2)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.1)
        nn.init.normal_(self.wpe.weight, std=0.1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LMOutput:
        h = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.h:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return LMOutput(loss, logits)


class GPTModule(L.LightningModule):
    """The GPT held in ``self.model``; ``call="model"``: the steps call ``self.model(input_ids=..., labels=...)``
    (as with Hugging Face models), ``"self"``: they call ``self(x)``. ``self_sharded``: ``configure_model``
    shards the blocks, then the LightningModule, itself."""

    def __init__(self, call: str = "model", self_sharded: bool = False) -> None:
        super().__init__()
        self.model = TiedGPT()
        self.call, self.self_sharded = call, self_sharded
        self.losses: list[float] = []
        self.batches: list[float] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        # Lightning calls configure_model at the start of every stage (fit, then validate, ...)
        if not self.self_sharded or isinstance(self, FSDPModule):
            return
        mesh = self.device_mesh["shard"]
        for block in self.model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, labels=x).loss

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        return self(x) if self.call == "self" else self.model(input_ids=x, labels=x).loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch[0])
        self.losses.append(float(loss.detach()))
        self.batches.append(float(batch[0].sum()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch[0]), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch[0]), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0]).logits.argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _tokens(n: int, seed: int) -> TensorDataset:
    """Sequences a model can learn: each token the previous one plus a step of the sequence's own."""
    g = torch.Generator().manual_seed(seed)
    start, step = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    return TensorDataset((start + step * torch.arange(CONTEXT)) % VOCAB)


class _SaveAtEpochEnd(L.Callback):
    """Write a checkpoint at the end of a given epoch (end-of-epoch: the reliable resume point)."""

    def __init__(self, epoch: int, path: str) -> None:
        self.epoch, self.path = epoch, path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, generator=torch.Generator().manual_seed(7))
    return TensorDataset(x, torch.sin(x @ w))


def _strategy(cfg: dict[str, Any]) -> Any:
    name = cfg.get("strategy", "sparse_fsdp")
    if name == "sparse_fsdp":
        return lightning_sparse.SparseFSDPStrategy(**cfg.get("args", {}))
    if name == "fsdp2":  # plain FSDP2 on the same mesh layout: Lightning's ModelParallelStrategy
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=cfg["devices"], tensor_parallel_size=1)
    return lightning_sparse.SparseDDPStrategy(**cfg.get("args", {}))


def fit_once(cfg: dict[str, Any]) -> None:
    L.seed_everything(0, verbose=False)
    gpt = cfg.get("model") == "gpt"
    model: Any = (
        GPTModule(cfg.get("call", "model"), cfg.get("self_sharded", False))
        if gpt
        else Blocks(self_sharded=cfg.get("self_sharded", False), nan_at=cfg.get("nan_at", (-1, -1)))
    )
    trainer = L.Trainer(
        accelerator=cfg.get("accelerator", "cpu"),
        devices=cfg["devices"],
        strategy=_strategy(cfg),
        max_steps=cfg["steps"],
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        limit_val_batches=2 if cfg.get("validate") else 0,
        gradient_clip_val=cfg.get("gradient_clip_val"),
        precision=cfg.get("precision", "32-true"),
        callbacks=[_SaveAtEpochEnd(cfg.get("save_epoch", 0), cfg["save_at_epoch_end"])]
        if cfg.get("save_at_epoch_end")
        else [],
    )
    # each process its own rows, in the same order every epoch: a resumed run sees the batches the
    # uninterrupted one saw (Lightning's own sampler reshuffles per epoch, and a strategy that restores
    # after setup, as Lightning's ModelParallelStrategy does, starts the resumed epoch's order late)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    rows = _tokens(cfg.get("samples", 512), 1) if gpt else _data(cfg.get("samples", 512), 1)
    sampler = DistributedSampler(rows, num_replicas=cfg["devices"], rank=rank, shuffle=False)
    train = DataLoader(rows, batch_size=8, sampler=sampler)
    val_rows = _tokens(64, 2) if gpt else _data(64, 2)
    val = DataLoader(val_rows, batch_size=16, sampler=DistributedSampler(val_rows, cfg["devices"], rank, shuffle=False))
    ckpt = cfg.get("resume_from")
    trainer.fit(model, train, val if cfg.get("validate") else None, ckpt_path=ckpt)
    result: dict[str, Any] = {"losses": model.losses, "batches": model.batches, "global_step": trainer.global_step}
    params = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params[name] = local.detach().clone()
    result["params"] = params
    result["checksum"] = sum(float(t.double().sum()) for t in params.values())
    strategy = trainer.strategy
    if isinstance(strategy, lightning_sparse.SparseFSDPStrategy):
        result["coords"] = strategy.device_mesh.get_coordinate()
        result["shard_size"] = strategy.shard_size
    if hasattr(strategy, "sparse_state"):
        state = strategy.sparse_state
        result["telemetry"] = state.telemetry.total.as_dict()
        result["group_bytes"] = state.telemetry.group_bytes
        result["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        result["residuals"] = state.memory.state_dict()
        update = strategy.update_exchange  # type: ignore[attr-defined]
        result["nonfinite_updates"] = None if update is None else update.nonfinite_updates
    if cfg.get("validate"):
        result["val_loss"] = float(trainer.validate(model, val, verbose=False)[0]["val_loss"])
    if cfg.get("evaluate"):  # then the other stages on the same Trainer, and the whole model after them
        result["test_loss"] = float(trainer.test(model, val, verbose=False)[0]["test_loss"])
        result["val_loss_again"] = float(trainer.validate(model, val, verbose=False)[0]["val_loss"])
        result["predictions"] = torch.cat(trainer.predict(model, val))
        # every unit's parameters gathered (an all-gather in each group, in the same order everywhere)
        result["full"] = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)
        }
        inner = model.model
        result["tied"] = inner.lm_head.weight is inner.wte.weight
    prefix = f"{cfg['name']}_" if cfg.get("name") else ""
    torch.save(result, f"{prefix}rank{trainer.global_rank}.pt")


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    runs = cfg.pop("runs", None)
    for run in runs or [{}]:
        fit_once({**cfg, **run})


if __name__ == "__main__":
    main()
    end_process_group(exit_code=0)
