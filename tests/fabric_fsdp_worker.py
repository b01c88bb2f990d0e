"""A Lightning Fabric loop with ``sparse_fsdp`` (or Fabric's ``sparse_ddp``) on tests/fsdp_worker.py's
model of blocks, launched by tests/test_fabric_fsdp.py through Fabric's popen launcher:

    python fabric_fsdp_worker.py config.json

The config's ``runs`` run one after the other in the same processes (a later run may resume from a
checkpoint an earlier one wrote). Every rank writes ``{name}_rank{r}.pt``: its local shards of the
global model, its residuals, the losses, the telemetry, its mesh coordinates and an evaluation loss.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from fsdp_worker import Blocks, TiedGPT, _data, _tokens
from lightning.fabric import Fabric

import lightning_sparse
from lightning_sparse import end_process_group


def _shard_blocks(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """A parallelize_fn: the user's own sharding, on the mesh's ``"shard"`` dimension."""
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(module, mesh=mesh["shard"])
    return module


class LM(torch.nn.Module):
    """A module holding a Hugging Face-like causal LM in ``self.model``; the loop calls the submodule
    (``model.model(input_ids=x, labels=x)``), never this module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TiedGPT()


def _run_gpt(fabric: Fabric, cfg: dict[str, Any]) -> dict[str, Any]:
    model = fabric.setup_module(LM())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    rank, world = fabric.global_rank, fabric.world_size
    (tokens,) = _tokens(256, 1).tensors
    losses = []
    for step in range(cfg["steps"]):
        x = tokens[(torch.arange(8) + (step * world + rank) * 8) % len(tokens)]
        loss = model.model(input_ids=x, labels=x).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if step == cfg["steps"] // 2:  # an evaluation in the middle of the loop, then training on
            model.eval()
            with torch.no_grad():
                model.model(input_ids=_tokens(16, 2).tensors[0]).logits.sum()
            model.train()
    model.eval()
    with torch.no_grad():
        eval_loss = float(model.model(input_ids=_tokens(64, 2).tensors[0], labels=_tokens(64, 2).tensors[0]).loss)
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.module.named_parameters(remove_duplicate=False)
    }
    inner = model.module.model
    return {"losses": losses, "eval_loss": eval_loss, "full": full, "tied": inner.lm_head.weight is inner.wte.weight}


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def run(cfg: dict[str, Any]) -> None:
    args = dict(cfg.get("args", {}))
    if cfg.get("strategy") == "sparse_ddp":
        strategy: Any = lightning_sparse.FabricSparseDDPStrategy(**args)
    else:
        if cfg.get("parallelize"):
            args["parallelize_fn"] = _shard_blocks
        strategy = lightning_sparse.FabricSparseFSDPStrategy(**args)
    fabric = Fabric(accelerator="cpu", devices=cfg["devices"], strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    if cfg.get("model") == "gpt":
        result = _run_gpt(fabric, cfg)
        sparse = fabric.strategy.sparse_state  # type: ignore[attr-defined]
        result["telemetry"] = sparse.telemetry.total.as_dict()
        result["coords"] = fabric.strategy.device_mesh.get_coordinate()  # type: ignore[attr-defined]
        torch.save(result, f"{cfg['name']}_rank{fabric.global_rank}.pt")
        fabric.barrier()
        return
    model = fabric.setup_module(Blocks())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.03))
    rank, world = fabric.global_rank, fabric.world_size
    rows = _data(cfg.get("samples", 512), 1)
    x_all, y_all = rows.tensors
    start = 0
    if cfg.get("resume_from"):
        state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
        fabric.load(cfg["resume_from"], state)
        start = state["step"]
    losses = []
    for step in range(start, cfg["steps"]):
        # data as a pure function of (step, rank): a resumed run sees the same batches
        idx = (torch.arange(8) + (step * world + rank) * 8) % len(rows)
        loss = (model(x_all[idx]) - y_all[idx]).pow(2).mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if cfg.get("save_at") == step + 1:
            fabric.save(cfg["save_to"], {"model": model, "optimizer": opt, "step": step + 1})
    unflushed = None
    if cfg.get("flush_residuals"):  # this process's shards and residuals before, then the flush
        fabric.strategy.global_model()  # type: ignore[attr-defined]
        sparse_state = fabric.strategy.sparse_state  # type: ignore[attr-defined]
        unflushed = {"params": {n: _local(p) for n, p in model.module.named_parameters()}}
        unflushed["residuals"] = {k: v.clone() for k, v in sparse_state.memory.state_dict().items()}
        fabric.strategy.flush_residuals()  # type: ignore[attr-defined]
    model.eval()
    with torch.no_grad():
        val = _data(64, 2).tensors
        eval_loss = float((model(val[0]) - val[1]).pow(2).mean())
    model.train()
    sparse = fabric.strategy.sparse_state  # type: ignore[attr-defined]
    result: dict[str, Any] = {
        "params": {n: _local(p) for n, p in model.module.named_parameters()},
        "residuals": sparse.memory.state_dict(),
        "losses": losses,
        "eval_loss": eval_loss,
        "telemetry": sparse.telemetry.total.as_dict(),
        "group_bytes": sparse.telemetry.group_bytes,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "unflushed": unflushed,
    }
    if isinstance(fabric.strategy, lightning_sparse.FabricSparseFSDPStrategy):
        result["coords"] = fabric.strategy.device_mesh.get_coordinate()
        result["shard_size"] = fabric.strategy.shard_size
    if cfg.get("check_joint_setup"):
        try:
            fabric.setup(Blocks(), torch.optim.SGD(Blocks().parameters(), lr=0.1))
        except RuntimeError as err:
            result["joint_setup_error"] = str(err)
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
