"""One fit of the convergence benchmark: what runs inside every rank of a worker subprocess."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning as L

from benchmarks.convergence.runs import ACCURACY, VAL_LOSS
from benchmarks.convergence.tasks import TASKS
from benchmarks.peers import CollectiveCounter, CommHookDDPStrategy, Peer, local_gradient_hook
from lightning_sparse import end_process_group


class _Recorder(L.Callback):
    """Per validation: optimizer steps, the validation figures, and this rank's cumulative bytes.

    ``counter``: for torch's hooks, the collective counter; it counts during training batches only
    (validation's metric syncs are not gradient traffic).
    """

    def __init__(self, counter: CollectiveCounter | None = None) -> None:
        self.points: list[dict[str, float]] = []
        self.param_bytes = 0
        self.counter = counter
        #: processes a dense all-reduce runs over (dense HSDP: the groups, one per shard index)
        self.ring_size: int | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # sharded: this process's shards, what dense HSDP all-reduces across groups every step
        local = [p.to_local() if hasattr(p, "to_local") else p for p in pl_module.parameters() if p.requires_grad]
        self.param_bytes = sum(p.numel() * p.element_size() for p in local)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.counter is not None:
            self.counter.start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self.counter is not None:
            self.counter.stop()

    def bytes_so_far(self, trainer: L.Trainer) -> tuple[int, int]:
        """(bytes sent, bytes plain DDP all-reduces) by this rank since the start of the fit."""
        dense = trainer.global_step * self.param_bytes  # dense DDP all-reduces every gradient each step
        if self.counter is not None:
            return self.counter.bytes, dense
        state = getattr(trainer.strategy, "sparse_state", None)
        if state is None:
            return dense, dense
        total = state.telemetry.total
        return int(total.sent_bytes), int(total.dense_bytes)

    def wire_so_far(self, trainer: L.Trainer) -> float:
        """Bytes through this rank since the start of the fit, under the ring model of each collective
        (dense DDP and torch's hooks all-reduce: 2 (W-1)/W of what they hand over)."""
        from lightning_sparse.wire import ring_all_reduce_bytes

        state = getattr(trainer.strategy, "sparse_state", None)
        if state is not None and self.counter is None:
            return float(state.telemetry.total.wire_bytes)
        return ring_all_reduce_bytes(self.ring_size or trainer.world_size, self.bytes_so_far(trainer)[0])

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        sent, dense = self.bytes_so_far(trainer)
        point: dict[str, float] = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        for metric in (ACCURACY, VAL_LOSS):
            if metric.logged in trainer.callback_metrics:
                point[metric.key] = float(trainer.callback_metrics[metric.logged])
        wire = self.wire_so_far(trainer)
        self.points.append({**point, "sent_bytes": sent, "dense_bytes": dense, "wire_bytes": wire})


def _sparse_strategy(config: dict[str, Any]) -> Any:
    """``SparseDDPStrategy`` of a sparse run, in the run's mode (runs without one compressed gradients);
    with a ``shard_size``, ``SparseFSDPStrategy`` in groups of that many processes."""
    import lightning_sparse

    cls: Any = lightning_sparse.SparseDDPStrategy
    extra: dict[str, Any] = {}
    if config.get("shard_size"):
        cls = lightning_sparse.SparseFSDPStrategy
        # None: the module shards itself in configure_model
        extra = {
            "shard_size": config["shard_size"],
            "sharded_modules": list(TASKS[config["task"]].sharded_modules) or None,
        }
    density: Any = config["density"]
    if config.get("density_start"):  # a density warm-up to the run's density
        steps = config.get("density_steps", 40)
        density = lightning_sparse.WarmupDensity(start=config["density_start"], end=density, steps=steps)
    return cls(
        **extra,
        compress=config.get("mode") or "gradient",
        compressor=config["compressor"],
        density=density,
        exchange=config.get("exchange") or "auto",
        value_dtype=config.get("value_dtype"),
        sync_every=config.get("sync_every", 1),
        outer_optimizer=_outer(config),
        value_bits=config.get("value_bits"),
        warmup_steps=config.get("warmup_steps", 1),
        sync_delay=config.get("sync_delay", 0),
        fragments=config.get("fragments", 1),
        fragment_split=config.get("fragment_split", "strided"),
        **({"flush_at_end": config["flush_at_end"]} if "flush_at_end" in config else {}),
        **({"batchnorm_warmup": config["batchnorm_warmup"]} if "batchnorm_warmup" in config else {}),
        **({"error_feedback_decay": config["error_feedback_decay"]} if "error_feedback_decay" in config else {}),
        **(
            {"outer_momentum": config["outer_momentum"]}
            if "outer_momentum" in config and "outer_lr" not in config
            else {}
        ),
        compression_monitor=False,
    )


def _outer(config: dict[str, Any]) -> Any:
    """The run's ``outer_optimizer``: with an ``outer_lr``, the Nesterov outer step at that learning rate."""
    if "outer_lr" not in config:
        return config.get("outer_optimizer")
    if config.get("outer_optimizer") != "nesterov":
        raise ValueError("outer_lr sets the learning rate of outer=nesterov")
    import functools

    import torch

    momentum = config.get("outer_momentum", 0.9)
    return functools.partial(torch.optim.SGD, lr=config["outer_lr"], momentum=momentum, nesterov=True)


def _demo(model: Any) -> tuple[Any, CollectiveCounter]:
    """DeMo (Peng, Quesnelle and Kingma, 2024) as pytorch-optimizer ships it: each rank keeps its own
    gradient (DDP's hook sends nothing) and the optimizer all-gathers the top DCT components of each
    rank's momentum itself; its collectives are counted."""
    import torch
    from pytorch_optimizer.optimizer import demo as demo_module

    def configure_optimizers() -> Any:
        return demo_module.DeMo(model.parameters(), lr=1e-3, compression_top_k=32, compression_chunk=64)

    model.configure_optimizers = configure_optimizers
    counter = CollectiveCounter()
    counter.install()
    if getattr(demo_module, "all_gather", None) is not None:  # the optimizer imported the name itself
        demo_module.all_gather = torch.distributed.all_gather
    return CommHookDDPStrategy(ddp_comm_state=None, ddp_comm_hook=local_gradient_hook), counter


def fit_run(config: dict[str, Any]) -> dict[str, Any] | None:
    """Train one run as ``config`` says; returns its figures on global rank 0, ``None`` elsewhere."""
    import torch

    torch.set_num_threads(1)  # N processes on N cores
    task = TASKS[config["task"]]
    L.seed_everything(config["seed"], verbose=False)
    model, data = task.build(config["seed"], bool(config.get("tiny")))
    counter: CollectiveCounter | None = None
    callbacks: list[L.Callback] = []
    if config.get("peer"):
        state, hook = Peer.parse(config["peer"]).registered_hook()
        strategy: Any = CommHookDDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)
        counter = CollectiveCounter()
        counter.install()
    elif config.get("demo"):
        strategy, counter = _demo(model)
    elif config.get("torchft"):
        from benchmarks.torchft_peer import TorchftDiLoCo

        diloco = TorchftDiLoCo(config["torchft"])
        callbacks.append(diloco)
        strategy, counter = CommHookDDPStrategy(ddp_comm_hook=local_gradient_hook), diloco.counter
    elif config["compressor"] is None and config.get("shard_size"):
        from benchmarks.convergence.hsdp import DenseHSDPStrategy

        strategy = DenseHSDPStrategy(config["shard_size"], list(task.sharded_modules))
    elif config["compressor"] is None:
        strategy = "ddp"
    else:
        strategy = _sparse_strategy(config)
    recorder = _Recorder(counter)
    if config.get("shard_size"):
        recorder.ring_size = config["devices"] // config["shard_size"]
    callbacks.append(recorder)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=config["devices"],
        strategy=strategy,
        max_epochs=config["epochs"],
        limit_train_batches=config.get("limit_train_batches"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    try:
        trainer.fit(model, datamodule=data)
    finally:
        if counter is not None:
            counter.uninstall()
    seconds = time.perf_counter() - start
    after = _evaluate_after_fit(trainer, model, data) if task.evaluate_after_fit else {}
    if not trainer.is_global_zero:
        return None
    sent, dense = recorder.bytes_so_far(trainer)
    last = recorder.points[-1] if recorder.points else {}
    result: dict[str, Any] = {
        "status": "ok",
        "final_acc": last.get("acc"),
        "final_loss": last.get("loss"),
        "steps": trainer.global_step,
        "sent_bytes": sent,
        "dense_bytes": dense,
        "wire_bytes": recorder.wire_so_far(trainer),
        "world_size": trainer.world_size,
        "param_bytes": recorder.param_bytes,
        "fit_seconds": seconds,
        "points": recorder.points,
    }
    result.update(after)
    if counter is not None:
        result["collective_calls"] = counter.calls
    state = getattr(trainer.strategy, "sparse_state", None)
    if state is not None:
        total = state.telemetry.total
        result["coordinate_density"] = total.density
        result["fallback_buckets"] = total.fallback_buckets
        result["buckets"] = total.buckets
        result["sent_as"] = {name: c.sent_bytes for name, c in sorted(state.telemetry.methods.items())}
    return result


def _evaluate_after_fit(trainer: L.Trainer, model: L.LightningModule, data: Any) -> dict[str, Any]:
    """Validate and test on the Trainer that fitted, then compare the whole model (every sharded
    parameter gathered) across all processes: its figures, on every rank."""
    import hashlib

    import torch
    import torch.distributed as dist

    val = trainer.validate(model, datamodule=data, verbose=False)[0]
    test = trainer.test(model, dataloaders=data.val_dataloader(), verbose=False)[0]
    digest = hashlib.sha256()
    for _, p in model.named_parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # an all-gather inside the group
        digest.update(whole.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(digests, digest.hexdigest())
    inner = getattr(model, "model", None)
    tied = None
    if inner is not None and hasattr(inner, "get_input_embeddings"):
        tied = inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
    figures = {
        "after_fit_val_loss": float(val["val_loss"]),
        "after_fit_test_loss": float(test["test_loss"]),
        "identical_on_all_processes": len(set(digests)) == 1,
        "tied": tied,
    }
    if "val_acc" in val:  # classification tasks
        figures["after_fit_val_acc"] = float(val["val_acc"])
    if "test_acc" in test:
        figures["after_fit_test_acc"] = float(test["test_acc"])
    return figures


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="one run of the convergence benchmark (started by it)")
    parser.add_argument("--worker", required=True, metavar="CONFIG", help="JSON file with the run's config")
    args = parser.parse_args(argv)
    config = json.loads(Path(args.worker).read_text())
    result = fit_run(config)
    if result is not None:
        Path(config["result"]).write_text(json.dumps(result))
    end_process_group(exit_code=0)  # on every rank together, then out: see its docstring
    return 0
