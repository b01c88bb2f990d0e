"""A Lightning Fabric training loop driven by a JSON config, for the Fabric tests.

    python fabric_worker.py config.json

Fabric's popen launcher re-runs this script for the other rank. The config holds common settings
and a list of ``runs``, run one after the other in the same two processes (a later run may resume
from a checkpoint an earlier one wrote). Every rank writes ``{name}_rank{r}.pt``: its final
parameters, residuals, optimizer state, the state's step and telemetry, and fingerprints of the
module after every optimizer step and at every evaluation.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from trainer_worker import make_data

from lightning_sparse import FabricSparseDDPStrategy
from lightning_sparse._utils import end_process_group


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def fingerprint(module: nn.Module) -> float:
    return float(sum((p.detach().double() * (i + 1)).sum() for i, p in enumerate(module.parameters())))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def run(cfg: dict[str, Any]) -> None:
    spec = cfg.get("strategy", "sparse_ddp")
    strategy = spec if isinstance(spec, str) else FabricSparseDDPStrategy(**spec)
    plugins: list[Any] = []
    if cfg.get("fp16"):  # fp16 AMP with a real gradient scaler (on CPU too)
        from lightning.fabric.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12)))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=plugins)
    fabric.launch()
    fabric.seed_everything(cfg.get("seed", 0), verbose=False)
    model = MLP()
    if cfg.get("optimizer") == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 0.01), weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.05), momentum=0.9)
    model, opt = fabric.setup(model, opt)
    data = make_data(0, cfg.get("n", 1024))
    x_all, y_all = data.tensors
    initial_acc = accuracy(model, x_all, y_all)
    start = 0
    if cfg.get("resume_from"):
        remainder = fabric.load(cfg["resume_from"], {"model": model, "optimizer": opt})
        start = remainder["step"]
    steps, bs, accumulate = cfg.get("steps", 30), cfg.get("batch_size", 16), cfg.get("accumulate", 1)
    after_step: list[float] = []
    at_eval: list[float] = []
    rank, world = fabric.global_rank, fabric.world_size
    batch = 0
    records: dict[int, dict[str, Any]] = {}
    for step in range(start, steps):
        for micro in range(accumulate):
            # data as a pure function of (step, micro-batch, rank): a resumed run sees the same batches
            first = ((step * accumulate + micro) * world + rank) * bs
            idx = torch.arange(first, first + bs) % len(data)
            x, y = x_all[idx], y_all[idx]
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = nn.functional.cross_entropy(model(x).float(), y)
                if step == cfg.get("nan_at") and rank == 1:
                    loss = loss * float("nan")  # an overflow on one rank
                fabric.backward(loss)
            batch += 1
            if cfg.get("eval_every") and batch % cfg["eval_every"] == 0:
                # an evaluation, possibly in the middle of an accumulation cycle
                model.eval()
                with torch.no_grad():
                    model(x_all[:64])
                at_eval.append(fingerprint(model))
                model.train()
        opt.step()
        opt.zero_grad()
        after_step.append(fingerprint(model))
        if step + 1 in cfg.get("record_steps", []):  # the state after the step
            sparse = fabric.strategy.sparse_state  # type: ignore[attr-defined]
            scaler = getattr(fabric.strategy.precision, "scaler", None)
            records[step + 1] = {
                "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "residuals": sparse.memory.state_dict(),
                "cycle": dict(sparse.cycle),
                "scale": None if scaler is None else float(scaler.get_scale()),
                "sent_bytes": sparse.telemetry.last.sent_bytes,
            }
        if cfg.get("save_at") == step + 1:
            fabric.save(cfg["save_to"], {"model": model, "optimizer": opt, "step": step + 1})
    fabric.strategy.global_model()  # type: ignore[attr-defined]  # the loop may end inside a cycle
    state = fabric.strategy.sparse_state  # type: ignore[attr-defined]
    unflushed = None
    if cfg.get("flush_residuals"):  # the global model and the residuals before, then the flush
        unflushed = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        unflushed["residuals"] = {k: v.clone() for k, v in state.memory.state_dict().items()}
        unflushed["sent_bytes"] = state.telemetry.total.sent_bytes
        if cfg["flush_residuals"] == "end_fit":  # what the docs' loops call after their last step
            fabric.strategy.end_fit()  # type: ignore[attr-defined]
        else:
            rounds = cfg["flush_residuals"] if cfg["flush_residuals"] is not True else None
            fabric.strategy.flush_residuals(rounds)  # type: ignore[attr-defined]
    result = {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "residuals": state.memory.state_dict(),
        "optimizer": opt.state_dict(),
        "hook_step": state.step,
        "telemetry": state.telemetry.total.as_dict(),
        "compression_ratio": state.telemetry.total.compression_ratio,
        "after_step": after_step,
        "at_eval": at_eval,
        "initial_acc": initial_acc,
        "final_acc": accuracy(model, x_all, y_all),
        "strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__,
        "compress": fabric.strategy.compress,  # type: ignore[attr-defined]
        "records": records,
        "skipped_steps": 0 if state.skips is None else state.skips.skipped,
        "unflushed": unflushed,
        "nonfinite_updates": getattr(fabric.strategy.update_exchange, "nonfinite_updates", None),  # type: ignore[attr-defined]
    }
    torch.save(result, f"{cfg['name']}_rank{rank}.pt")
    fabric.barrier()


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    runs = cfg.pop("runs")
    for r in runs:
        run({**cfg, **r})


if __name__ == "__main__":
    main()
    end_process_group(exit_code=0)
