"""A Lightning training run driven by a JSON config, for the distributed Trainer tests.

    python trainer_worker.py config.json

Lightning's popen launcher re-runs this script for the other ranks. Every rank writes
``rank{r}.pt`` into the working directory: its final parameters, the hook's step and telemetry
(with a spawn strategy only the main process, rank 0, writes).

``"intercept_collectives": true`` wraps torch.distributed's collectives and records, per
optimizer step, the bytes of every tensor the communication hook hands to them: a count of the
traffic that does not rely on the package's own counters.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections import defaultdict
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sparse
from lightning_sparse import SparseDDPStrategy
from lightning_sparse._utils import end_process_group
from lightning_sparse.exchange.hook import sparse_comm_hook
from lightning_sparse.exchange.update import UpdateExchange


class Net(L.LightningModule):
    """A small MLP; variants exercise unused and frozen parameters and non-finite gradients."""

    def __init__(self, variant: str = "mlp", lr: float = 0.05, nan_at_step: int = -1, nan_rank: int = -1) -> None:
        super().__init__()
        self.nan_rank = nan_rank
        self.variant = variant
        self.lr = lr
        self.nan_at_step = nan_at_step
        self.data: TensorDataset | None = None
        self.momentum = 0.9
        self.optimizer_name = "sgd"
        self.scheduler = False
        self.skipped_steps = 0
        self.skip_nonfinite = True  # False: a non-finite gradient reaches the optimizer
        self.residual_norms: list[float] = []
        self.sent_numel: list[int] = []
        #: global steps at whose batch end the module, residuals, cycle and loss scale are recorded
        self.record_steps: set[int] = set()
        self.records: dict[int, dict[str, Any]] = {}
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        if variant == "batchnorm":
            self.body = nn.Sequential(
                nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 64), nn.BatchNorm1d(64), nn.ReLU()
            )
        self.head = nn.Linear(64, 4)
        if variant == "unused":
            self.unused = nn.Linear(64, 64)  # never in the graph
        if variant == "sometimes_unused":
            # in the graph on every other step, and on each step on one rank only
            self.sometimes = nn.Linear(64, 64)
        if variant == "frozen":
            for p in self.body[0].parameters():
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.variant == "sometimes_unused" and self.training and (self.global_step + self.global_rank) % 2 == 0:
            h = h + self.sometimes(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.data is not None:
            # Data as a pure function of (step, rank): a resumed run sees exactly the batches the
            # uninterrupted run saw, whatever Lightning's loop does with epochs and samplers on restart.
            n, bs, world = len(self.data), x.shape[0], self.trainer.world_size
            start = (self.global_step * world + self.global_rank) * bs
            idx = torch.arange(start, start + bs) % n
            x, y = self.data.tensors[0][idx].to(x.device), self.data.tensors[1][idx].to(y.device)
        loss = nn.functional.cross_entropy(self(x).float(), y)
        nan_now = self.global_step == self.nan_at_step or (self.nan_at_step == -2 and self.global_step > 0)
        if nan_now and self.nan_rank in (-1, self.global_rank):  # -2: at every step from the second
            loss = loss * float("nan")
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # What a gradient scaler does: skip a step whose (averaged) gradient is not finite.
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if self.skip_nonfinite and not all(torch.isfinite(g).all() for g in grads):
            self.skipped_steps += 1
            for p in self.parameters():
                p.grad = None

    def on_train_batch_end(self, *args: Any) -> None:
        # after the step's exchange in both modes (the hook runs before the optimizer step, the
        # update exchange after it)
        strategy = self.trainer.strategy
        if isinstance(strategy, SparseDDPStrategy):
            self.residual_norms.append(strategy.sparse_state.memory.norm_sq() ** 0.5)
            self.sent_numel.append(strategy.sparse_state.telemetry.last.sent_numel)
            if self.global_step in self.record_steps:  # the state after the step global_step - 1
                state = strategy.sparse_state
                scaler = getattr(self.trainer.precision_plugin, "scaler", None)
                self.records[self.global_step] = {
                    "params": {k: v.detach().clone() for k, v in self.state_dict().items()},
                    "residuals": state.memory.state_dict(),
                    "cycle": dict(state.cycle),
                    "scale": None if scaler is None else float(scaler.get_scale()),
                    "sent_bytes": state.telemetry.last.sent_bytes,
                    "methods": sorted(state.telemetry.methods),
                }

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y), sync_dist=True, batch_size=len(x))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x).float(), y), sync_dist=True, batch_size=len(x))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).float()


class ManualNet(Net):
    """Manual optimization with two optimizers (SGD for the body, AdamW for the head)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_body, opt_head = self.optimizers()
        loss = nn.functional.cross_entropy(self(x).float(), y)
        opt_body.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(loss)
        opt_head.step()
        opt_body.step()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.body.parameters(), lr=self.lr, momentum=self.momentum),
            torch.optim.AdamW(self.head.parameters(), lr=0.01),
        )


class Snapshots(L.Callback):
    """What callbacks see: a fingerprint of the module's parameters at batch ends and validation starts."""

    def __init__(self) -> None:
        self.batch_end: list[float] = []
        self.validation_start: list[float] = []

    @staticmethod
    def fingerprint(module: nn.Module) -> float:
        return float(sum((p.detach().double() * (i + 1)).sum() for i, p in enumerate(module.parameters())))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.batch_end.append(self.fingerprint(pl_module))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validation_start.append(self.fingerprint(pl_module))


def _precision(precision: str) -> dict[str, Any]:
    """Trainer arguments for ``precision``; "16-mixed-scaler" is fp16 AMP with a real gradient
    scaler on any device (Lightning turns "16-mixed" into bf16 on CPU)."""
    if precision != "16-mixed-scaler":
        return {"precision": precision}
    from lightning.pytorch.plugins.precision import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))]}


def make_data(seed: int = 0, n: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 4, generator=g)
    y = (x @ w).argmax(1)
    return TensorDataset(x, y)


@torch.no_grad()
def _accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    first = next(model.parameters())
    return (model(x.to(first.device, first.dtype)).argmax(1).cpu() == y).float().mean().item()


class WireTap(L.Callback):
    """Wraps the torch.distributed collectives; records the input bytes of those called by the hook."""

    #: collective -> (position, keyword) of the tensor this rank contributes
    INPUT = {
        "all_reduce": (0, "tensor"),
        "broadcast": (0, "tensor"),
        "all_gather": (1, "tensor"),
        "all_gather_single": (1, "input_tensor"),
        "all_gather_into_tensor": (1, "input_tensor"),
        "reduce_scatter_tensor": (1, "input"),
        "all_to_all_single": (1, "input"),
    }

    def __init__(self) -> None:
        self.step = 0
        self.bytes_by_step: dict[int, int] = defaultdict(int)
        self.inside = threading.local()

    def install(self) -> None:
        for name in self.INPUT:
            real = getattr(dist, name, None)
            if real is not None:
                setattr(dist, name, self._wrap(name, real))

    def _wrap(self, name: str, real: Any) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            # count the outermost call only (all_gather_into_tensor calls all_gather_single)
            outer = not getattr(self.inside, "active", False)
            if outer and _called_from_hook():
                # the tensor this rank contributes: all_reduce(tensor), all_gather_single(out, input), ...
                position, keyword = self.INPUT[name]
                tensor = args[position] if len(args) > position else kwargs[keyword]
                nbytes = tensor.numel() * tensor.element_size()
                self.bytes_by_step[self.step] += nbytes
            self.inside.active = True
            try:
                return real(*args, **kwargs)
            finally:
                if outer:
                    self.inside.active = False

        return collective

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.step = trainer.global_step


def _called_from_hook() -> bool:
    """Whether the hook launched this collective: from its own call, or from a completion callback
    of one of its collectives (a second round), which runs on a backend thread. Lightning's own
    collectives (metric syncs, barriers, stop decisions) come from the main thread, outside the hook."""
    if threading.current_thread() is not threading.main_thread():
        return True
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in (sparse_comm_hook.__code__, UpdateExchange.exchange.__wrapped__.__code__):
            return True
        frame = frame.f_back
    return False


def build_strategy(spec: Any) -> Any:
    if isinstance(spec, str):
        return spec
    spec = dict(spec)
    args = spec.pop("compressor_args", None)
    if args is not None:  # a compressor built from its class with typed arguments
        spec["compressor"] = lightning_sparse.COMPRESSORS[spec.get("compressor", "topk")](**args)
    density = spec.get("density")
    if isinstance(density, dict):  # a schedule, written as the Lightning CLI writes it
        module, _, name = density["class_path"].rpartition(".")
        spec["density"] = getattr(importlib.import_module(module), name)(**density.get("init_args", {}))
    if "timeout_s" in spec:  # a short process-group timeout (stall tests)
        spec["timeout"] = datetime.timedelta(seconds=spec.pop("timeout_s"))
    outer = spec.get("outer_optimizer")
    if isinstance(outer, dict):  # an optimizer factory, written as the Lightning CLI writes it
        module, _, name = outer["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        spec["outer_optimizer"] = functools.partial(cls, **outer.get("init_args", {}))
    return SparseDDPStrategy(**spec)


class _SaveAtEpochEnd(L.Callback):
    """Write a checkpoint at the end of a given epoch (end-of-epoch: the reliable resume point)."""

    def __init__(self, epoch: int, path: str) -> None:
        self.epoch, self.path = epoch, path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


class _Stall(L.Callback):
    """At a given optimizer step, one rank stops (SIGSTOP, as a hung process would), dies (SIGKILL) or
    raises inside the exchange (its compressor fails), so that the other ranks wait in a collective."""

    def __init__(self, step: int, rank: int, how: str) -> None:
        self.step, self.rank, self.how = step, rank, how

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.how == "kill":  # a rank that dies at once (OOM killer, a lost node)
            print(f"rank {trainer.global_rank} killed at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            state = trainer.strategy.sparse_state

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("the compressor failed on purpose")

            state.compressor.select = broken  # type: ignore[method-assign]
            from lightning_sparse.wire import batched

            batched.batched_topk = broken  # the bucket-at-once selection does not call select


def fit_once(cfg: dict[str, Any]) -> None:
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    cls = ManualNet if cfg.get("manual") else Net
    model = cls(cfg.get("model", "mlp"), cfg.get("lr", 0.05), cfg.get("nan_at_step", -1), cfg.get("nan_rank", -1))
    model.momentum = cfg.get("momentum", 0.9)
    model.skip_nonfinite = cfg.get("skip_nonfinite", True)
    model.optimizer_name = cfg.get("optimizer", "sgd")
    model.scheduler = cfg.get("scheduler", False)
    model.record_steps = set(cfg.get("record_steps", []))
    data = make_data(cfg.get("seed", 0), cfg.get("n", 1024))
    initial_acc = _accuracy(model, data)
    if cfg.get("data_by_step"):
        model.data = data
    # shuffle=False: the data order must not depend on anything but the step (resume tests)
    loader = DataLoader(data, batch_size=cfg.get("batch_size", 16), shuffle=False)
    callbacks: list[L.Callback] = []
    if "ckpt_at_epoch" in cfg:
        callbacks.append(_SaveAtEpochEnd(cfg["ckpt_at_epoch"], cfg["ckpt_out"]))
    snapshots = Snapshots()
    callbacks.append(snapshots)
    if cfg.get("checkpoint_every"):
        callbacks.append(ModelCheckpoint(dirpath="ckpts", every_n_train_steps=cfg["checkpoint_every"], save_last=True))
    val_loader = None
    if cfg.get("validate"):
        val_loader = DataLoader(data, batch_size=len(data), shuffle=False)  # one batch per rank
    tap = None
    if cfg.get("intercept_collectives"):
        tap = WireTap()
        tap.install()
        callbacks.append(tap)
    logger: Any = False
    if cfg.get("logger") == "csv":
        logger = CSVLogger(save_dir=".", name="csv", version=0)
    if cfg.get("flush_residuals"):
        callbacks.append(lightning_sparse.FlushResiduals())
    if cfg.get("stall_at_step") is not None:
        callbacks.append(_Stall(cfg["stall_at_step"], cfg.get("stall_rank", 1), cfg.get("stall", "stop")))
    trainer = L.Trainer(
        accelerator=cfg.get("accelerator", "cpu"),
        devices=cfg.get("devices", 2),
        strategy=build_strategy(cfg.get("strategy", "sparse_ddp")),
        max_steps=cfg.get("max_steps", 30),
        max_epochs=-1,
        accumulate_grad_batches=cfg.get("accumulate_grad_batches", 1),
        gradient_clip_val=cfg.get("gradient_clip_val"),
        **_precision(cfg.get("precision", "32-true")),
        logger=logger,
        log_every_n_steps=cfg.get("log_every_n_steps", 50),
        enable_checkpointing=bool(cfg.get("checkpoint_every")),
        # an integer: validate every that many training batches, across epochs
        val_check_interval=cfg.get("val_check_interval"),
        check_val_every_n_epoch=None if cfg.get("val_check_interval") else 1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    slow = cfg.get("slow_dense_all_reduce")  # seconds of sleep before a whole-bucket dense all-reduce
    real_all_reduce = lightning_sparse.wire.comm.all_reduce
    if slow:
        param_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)

        def slow_all_reduce(t: torch.Tensor, group: Any = None) -> Any:
            if t.numel() == param_numel:  # the model is one bucket
                time.sleep(slow)
            return real_all_reduce(t, group)

        lightning_sparse.wire.comm.all_reduce = slow_all_reduce
    slow_sparse = cfg.get("slow_sparse")  # seconds of sleep before every sparse message's all-gather
    real_all_gather = lightning_sparse.wire.comm.all_gather
    if slow_sparse:

        def slow_all_gather(out: torch.Tensor, t: torch.Tensor, group: Any = None) -> Any:
            time.sleep(slow_sparse)
            return real_all_gather(out, t, group)

        lightning_sparse.wire.comm.all_gather = slow_all_gather
    # record_warnings: the fit's warnings in the result (several runs of one launch share one log)
    with warnings.catch_warnings(record=bool(cfg.get("record_warnings"))) as caught:
        if caught is not None:
            warnings.simplefilter("always")
        try:
            trainer.fit(model, loader, val_loader, ckpt_path=cfg.get("ckpt_path"))
        finally:
            lightning_sparse.wire.comm.all_reduce = real_all_reduce
            lightning_sparse.wire.comm.all_gather = real_all_gather
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    extra: dict[str, Any] = {}
    if cfg.get("test"):
        extra["test"] = trainer.test(model, val_loader, verbose=False)
    if cfg.get("predict"):
        extra["predict"] = torch.cat(trainer.predict(model, val_loader))
    if cfg.get("save_ckpt"):
        trainer.save_checkpoint(cfg["save_ckpt"])
    result: dict[str, Any] = {
        "params": {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()},
        "global_step": trainer.global_step,
        "initial_acc": initial_acc,
        "train_acc": _accuracy(model, data),
        "skipped_steps": model.skipped_steps,
        "records": model.records,
        "callback_metrics": fit_metrics,
        "cwd": os.getcwd(),
        "snapshots": {"batch_end": snapshots.batch_end, "validation_start": snapshots.validation_start},
        **extra,
        "callbacks": [type(cb).__name__ for cb in trainer.callbacks],
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        "warnings": [str(w.message) for w in caught or []],
    }
    if tap is not None:
        result["wire_bytes_by_step"] = dict(tap.bytes_by_step)
    strategy = trainer.strategy
    if isinstance(strategy, SparseDDPStrategy):
        state = strategy.sparse_state
        result["hook_step"] = state.step
        result["telemetry"] = state.telemetry.total.as_dict()
        result["residuals"] = state.memory.state_dict()
        result["velocity"] = state.velocity.state_dict()
        result["residual_norms"] = model.residual_norms
        result["sent_numel"] = model.sent_numel
        result["schedule_state"] = state.schedule.state_dict()
        result["methods"] = {k: v.buckets for k, v in state.telemetry.methods.items()}
        if strategy.update_exchange is not None:
            result["nonfinite_updates"] = strategy.update_exchange.nonfinite_updates
        result["optimizer_state"] = trainer.optimizers[0].state_dict()["state"] if trainer.optimizers else {}
        if state.timed_fallback is not None:
            result["timed_fallback"] = state.timed_fallback.state_dict()
    prefix = f"{cfg['name']}_" if cfg.get("name") else ""
    torch.save(result, f"{prefix}rank{trainer.global_rank}.pt")


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    runs = cfg.pop("runs", None)
    for run in runs or [{}]:
        fit_once({**cfg, **run})
    assert lightning_sparse.__version__


if __name__ == "__main__":
    main()
    end_process_group(exit_code=0)
