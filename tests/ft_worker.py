"""One fault-tolerant replica group's Trainer (or Fabric) fit, driven by a JSON config, for tests/test_ft.py.

    REPLICA_GROUP_ID=g NUM_REPLICA_GROUPS=n TORCHFT_LIGHTHOUSE=http://... python ft_worker.py config.json

Every step appends the Trainer's global step to ``progress_g{g}_r{rank}.txt`` (the test watches it to
kill, stop and restart groups); at the end each process writes ``result_g{g}_r{rank}.pt``: its global
model, the steps it took, its validation loss and the exchange's counters. ``"die_in_exchange": N``
makes the group's process kill itself inside the exchange of step N (in its first collective);
``"checkpoint_dir"`` saves Lightning's checkpoints in its ``g{g}/``, ``"resume"`` fits on from one;
``"check_rollback": true`` checks, at every exchange that rolled back, that the residuals, the global
model and the process's view are exactly as before it (written to the result). ``"strategy": "fsdp"``
shards each group's model across its processes with ``sparse_fsdp`` (each ``Linear`` a unit); the
result then holds each process's shards.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sparse  # noqa: F401  (registers the strategy names)
import lightning_sparse.wire.comm as comm
from lightning_sparse import SparseDDPStrategy, SparseFSDPStrategy
from lightning_sparse.exchange.ft import ReplicaCommit
from lightning_sparse.exchange.update import UpdateExchange

DIM, HIDDEN = 16, 32


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(1234))
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Net(L.LightningModule):
    def __init__(self, step_sleep: float, nan_at_step: int = -1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
        self.step_sleep = step_sleep
        self.nan_at_step = nan_at_step  # this group's loss times NaN at that step (AdamW's moments go NaN)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step_sleep:
            time.sleep(self.step_sleep)
        loss = nn.functional.mse_loss(self.net(x), y)
        return loss * float("nan") if self.global_step == self.nan_at_step else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Progress(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.steps.append(trainer.global_step)
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step}\n")


def _watch_rollbacks(update: UpdateExchange, checks: list[bool]) -> None:
    """Wrap the exchange: where it rolls back, compare the state after with the state before. With
    ``sync_delay`` the exchange rolls back where it arrives, steps after its launch: then the global
    model is as at the launch and each residual holds all the process had not had averaged at the
    launch (``e = view - global`` there: conservation with nothing sent)."""
    original = update.exchange
    commit = update.commit
    assert isinstance(commit, ReplicaCommit)
    launch: dict[str, dict[str, torch.Tensor]] = {}

    def exchange(params: Any = None) -> None:
        before_rollbacks = commit.rollbacks
        views = {n: p.detach().clone() for n, p in update._params.items()}
        glob = update.global_values()
        residuals = {n: update.state.memory.get(n).clone() for n in update._params if n in update.state.memory}
        awaiting = commit._awaiting
        original(params)
        if commit._awaiting is not None and commit._awaiting is not awaiting:  # launched here (sync_delay)
            launch.update(views=views, glob=glob)
        elif commit.rollbacks > before_rollbacks and awaiting is not None:  # rolled back where it arrived
            now_glob = update.global_values()
            same = all(torch.equal(launch["glob"][n], now_glob[n]) for n in update._params)
            for n in update._params:
                e = update.state.memory.get(n) if n in update.state.memory else None
                if e is not None:
                    unsent = launch["views"][n] - launch["glob"][n]
                    same &= torch.allclose(e.view_as(unsent), unsent, rtol=0, atol=1e-6)
            checks.append(bool(same))
        elif commit.rollbacks > before_rollbacks:
            same = all(torch.equal(views[n], p) for n, p in update._params.items())
            now_glob = update.global_values()
            same &= all(torch.equal(glob[n], now_glob[n]) for n in update._params)
            now = {n: update.state.memory.get(n) for n in update._params if n in update.state.memory}
            same &= now.keys() == residuals.keys() and all(torch.equal(residuals[n], now[n]) for n in now)
            checks.append(bool(same))

    update.exchange = exchange  # type: ignore[method-assign]


def _die_in_exchange(step: int, trainer_ref: list[Any]) -> None:
    original = comm.all_gather

    def all_gather(output: Any, tensor: Any, group: Any = None) -> Any:
        if trainer_ref and trainer_ref[0].global_step + 1 >= step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(output, tensor, group)

    comm.all_gather = all_gather  # type: ignore[assignment]


def _settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The strategy's arguments for either front end; FSDP2 shards every ``Linear``."""
    fsdp = {"sharded_modules": ["Linear"]} if cfg.get("strategy") == "fsdp" else {}
    return {"fault_tolerant": cfg.get("fault_tolerant", True), **fsdp}


def _local(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters as this process holds them (its shards under FSDP2)."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in module.named_parameters()}


def fabric_main(cfg: dict[str, Any], group: int) -> None:
    """The same fit as a Fabric loop: it runs until the group's step count (taken over when healing) ends."""
    from lightning_sparse.fabric import SparseDDPStrategy as FabricStrategy
    from lightning_sparse.fabric import SparseFSDPStrategy as FabricFSDPStrategy

    shell = FabricFSDPStrategy if cfg.get("strategy") == "fsdp" else FabricStrategy
    strategy = shell(
        **_settings(cfg),
        compressor="topk",
        density=0.1,
        sync_every=cfg.get("sync_every", 4),
        value_bits=cfg.get("value_bits", 2),
        min_numel=0,
        quorum_timeout=cfg.get("quorum_timeout", 10.0),
    )
    fabric = L.Fabric(accelerator="cpu", devices=cfg.get("devices", 1), strategy=strategy)
    fabric.launch()
    module = Net(cfg.get("step_sleep", 0.0))
    if cfg.get("strategy") == "fsdp":  # FSDP2 replaces the parameters: the module first, then its optimizer
        model = fabric.setup_module(module.net)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        model, optimizer = fabric.setup(module.net, torch.optim.AdamW(module.net.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(data(4096, seed=7), batch_size=16, shuffle=True))
    update = strategy.update_exchange
    assert update is not None and isinstance(update.commit, ReplicaCommit)
    ft = update.commit
    steps: list[int] = []
    path = f"progress_g{group}_r{fabric.global_rank}.txt"
    while update.steps < cfg["max_steps"]:  # the documented Fabric loop
        for x, y in loader:
            if module.step_sleep:
                time.sleep(module.step_sleep)
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps.append(ft.steps)
            with open(path, "a") as f:
                f.write(f"{ft.steps}\n")
            if ft.steps >= cfg["max_steps"]:
                break
    strategy.global_model()
    val = data(512, seed=99)
    with torch.no_grad():
        loss_value = nn.functional.mse_loss(model(val.tensors[0]), val.tensors[1]).item()
    result = {
        "params": _local(model),
        "steps": steps,
        "val_loss": loss_value,
        "global_step": ft.steps,
        "commits": ft.commits,
        "rollbacks": ft.rollbacks,
        "heals": ft.heals,
        "quorum_seconds": ft.quorum_seconds,
        "participants": ft.participants,
        "rollback_checks": [],
        "bytes": strategy.sparse_state.telemetry.total.sent_bytes,
    }
    torch.save(result, f"result_g{group}_r{fabric.global_rank}.pt")
    update.close()


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    group = int(os.environ["REPLICA_GROUP_ID"])
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    if cfg.get("front") == "fabric":
        fabric_main(cfg, group)
        return
    shell = SparseFSDPStrategy if cfg.get("strategy") == "fsdp" else SparseDDPStrategy
    strategy = shell(
        **_settings(cfg),
        compressor="topk",
        density=cfg.get("density", 0.1),
        sync_every=cfg.get("sync_every", 4),
        value_bits=cfg.get("value_bits", 2),
        fragments=cfg.get("fragments", 1),
        sync_delay=cfg.get("sync_delay", 0),
        min_numel=0,
        min_replicas=cfg.get("min_replicas", 1),
        quorum_timeout=cfg.get("quorum_timeout", 10.0),
    )
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    progress = Progress(f"progress_g{group}_r{rank}.txt")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 1),
        strategy=strategy,
        max_steps=cfg["max_steps"],
        logger=False,
        enable_checkpointing=bool(cfg.get("checkpoint_dir")),
        default_root_dir=f"{cfg['checkpoint_dir']}/g{group}" if cfg.get("checkpoint_dir") else None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[progress],
    )
    trainer_ref: list[Any] = []
    if cfg.get("die_in_exchange"):
        _die_in_exchange(int(cfg["die_in_exchange"]), trainer_ref)
    trainer_ref.append(trainer)
    checks: list[bool] = []
    nan_at = cfg.get("nan_at", {}).get(str(group), -1)  # {group: step}
    module = Net(cfg.get("step_sleep", 0.0), nan_at)
    if cfg.get("check_rollback"):

        class Watch(L.Callback):
            def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                update = trainer.strategy.update_exchange  # type: ignore[attr-defined]
                assert isinstance(update.commit, ReplicaCommit)
                _watch_rollbacks(update, checks)

        trainer.callbacks.append(Watch())  # type: ignore[attr-defined]
    loader = DataLoader(data(4096, seed=7), batch_size=16, shuffle=True)
    trainer.fit(module, loader, ckpt_path=cfg.get("resume"))
    val = data(512, seed=99)
    with torch.no_grad():  # under FSDP2 the processes of a group gather their shards together here
        loss = nn.functional.mse_loss(module.net(val.tensors[0]), val.tensors[1]).item()
    update = strategy.update_exchange
    ft = update.commit if update is not None and isinstance(update.commit, ReplicaCommit) else None
    result = {
        "params": _local(module),
        "steps": progress.steps,
        "val_loss": loss,
        "global_step": trainer.global_step,
        "batches": len(trainer.train_dataloader) if trainer.train_dataloader is not None else None,
        "commits": ft.commits if ft else 0,
        "rollbacks": ft.rollbacks if ft else 0,
        "heals": ft.heals if ft else 0,
        "quorum_seconds": ft.quorum_seconds if ft else 0.0,
        "participants": ft.participants if ft else 0,
        "rollback_checks": checks,
        "bytes": strategy.sparse_state.telemetry.total.sent_bytes,
        "nonfinite_updates": update.nonfinite_updates if update is not None else 0,
    }
    torch.save(result, f"result_g{group}_r{trainer.global_rank}.pt")
    if ft is not None:
        ft.close()


if __name__ == "__main__":
    main()
