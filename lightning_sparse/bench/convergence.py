"""Validation metric against bytes sent: dense DDP, each compressor at several densities (gradient and update
compression) and torch's own communication hooks, on real multi-process fits.

    python -m lightning_sparse.bench convergence                                  # everything, hours on 2 cores
    python -m lightning_sparse.bench convergence --tasks text --compressors topk dgc --densities 0.01 --epochs 2
    python -m lightning_sparse.bench convergence --tasks gpt --compressors topk --densities 0.01 0.001 --modes update

For each task (``digits``: an MLP on scikit-learn's handwritten digits; ``text``: a GRU predicting
the next character of Python standard-library source; ``gpt``: a small transformer language model
on the same source, AdamW) it trains the same model from the same initial weights and data order
with dense DDP, with ``SparseDDPStrategy`` (error feedback on) for every compressor, density and
mode (``gradient``: the DDP comm hook sparsifies gradients; ``update``: each rank steps on its own
gradient and the strategy sparsifies the model update), and with torch's own DDP communication
hooks (``--peers``: PowerSGD of a given rank, fp16, bf16). Each run is a real
``lightning.Trainer(accelerator="cpu", devices=N)`` fit, launched as its own subprocess (Lightning's
popen launcher starts the other ranks; gloo; one thread per process), so a hung or crashed rank
shows as its row's status instead of hanging the benchmark.

Each task declares its metric: validation accuracy (higher is better) for digits and text,
validation loss in nats (lower is better) for gpt.

Bytes are what rank 0 handed to ``torch.distributed``: for sparse runs the strategy's telemetry
(values, indices, the dense small tensors, the dense first step, dense fallbacks); for dense DDP the
all-reduced gradients, optimizer steps x sum of parameter bytes, which is what the telemetry's
``dense_bytes`` counts too; for torch's hooks the tensors the hook handed to the collectives during
training steps (counted by wrapping ``torch.distributed``'s collectives in the worker). The metric
is the one after the last validation.

Writes to ``--out`` (default ``convergence_out``): ``convergence.md`` (one markdown table per
task), ``convergence.json`` (every run, with its metric after each validation against the bytes
sent until then) and ``convergence_<task>.png`` (the validation metric against cumulative bytes
sent, log x axis; needs matplotlib: ``pip install "lightning_sparse[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L

from lightning_sparse._utils import end_process_group
from lightning_sparse.bench.peers import PEER_HELP, CollectiveCounter, CommHookDDPStrategy, Peer

DEFAULT_DENSITIES = [0.1, 0.01, 0.001]
MODES = ("gradient", "update")
DEFAULT_PEERS = ["powersgd:1", "powersgd:4"]
DENSE = "dense DDP"
#: the accuracy tasks' target: at this density, within this many accuracy points of dense with at least this reduction
TARGET_DENSITY, TARGET_POINTS, TARGET_REDUCTION = 0.01, 1.0, 30.0
#: the gpt task's target: update-mode top-k at 0.01 within this many nats of dense and better than PowerSGD
#: rank 4 at equal or fewer bytes; at 0.001 better than PowerSGD rank 1
GPT_TARGET_NATS = 0.15
GPT_TARGETS = ((0.01, "powersgd:4", GPT_TARGET_NATS), (0.001, "powersgd:1", None))


@dataclass(frozen=True)
class Metric:
    """The validation figure a task is judged by.

    Args:
        key: its key in the runs' JSON: ``final_<key>`` and each point's ``<key>``.
        logged: the name the LightningModule logs it under.
        title: its name in tables and plots.
        higher_is_better: accuracy-like (True) or loss-like (False).
        unit: the unit of differences to dense (``points``, ``nats``).
        scale: difference in ``unit`` = ``scale`` x difference of the values.
        diff_format: format of a difference (``"+.2f"``).
        axis: the plots' y-axis label.

    Example:
        >>> VAL_LOSS.better(1.7, 1.8), ACCURACY.better(0.7, 0.8)
        (True, False)
        >>> ACCURACY.diff(0.895, 0.9)
        -0.5
    """

    key: str
    logged: str
    title: str
    higher_is_better: bool
    unit: str
    scale: float = 1.0
    diff_format: str = "+.2f"
    axis: str = ""

    def better(self, a: float, b: float) -> bool:
        """``a`` strictly better than ``b``."""
        return a > b if self.higher_is_better else a < b

    def diff(self, value: float, reference: float) -> float:
        """``value - reference`` in ``unit`` (positive: higher, whatever is better)."""
        return round(self.scale * (value - reference), 12)


ACCURACY = Metric("acc", "val_acc", "accuracy", True, "points", 100.0, "+.2f", "validation accuracy")
VAL_LOSS = Metric("loss", "val_loss", "val loss", False, "nats", 1.0, "+.3f", "validation loss (nats)")


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


def _digits(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    from lightning_sparse.tasks import DigitsClassifier, DigitsDataModule

    return DigitsClassifier(), DigitsDataModule(batch_size=32, seed=0)


def _text(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    from lightning_sparse.tasks import NextCharClassifier, TextDataModule

    return NextCharClassifier(), TextDataModule(batch_size=64, seed=0)


#: the gpt task's context (characters): 64 costs ~3x the step time of 32 on one CPU thread
GPT_CONTEXT = 32


def _gpt(seed: int, tiny: bool = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    from lightning_sparse.tasks import GPTDataModule, TinyGPT

    if tiny:
        return TinyGPT(context=16, width=32, layers=1, heads=2), GPTDataModule(16, context=16, n_train=4096, n_val=64)
    return TinyGPT(context=GPT_CONTEXT), GPTDataModule(batch_size=16, context=GPT_CONTEXT, n_val=1024, seed=0)


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
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lightning_sparse.compressors import COMPRESSORS

    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="default: %(default)s")
    parser.add_argument(
        "--compressors",
        nargs="*",
        default=list(COMPRESSORS),
        help="compressor names; none: --compressors with no value (default: %(default)s)",
    )
    parser.add_argument("--densities", type=float, nargs="+", default=DEFAULT_DENSITIES, help="default: %(default)s")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="what the strategy compresses, SparseDDPStrategy(compress=MODE) (default: %(default)s)",
    )
    parser.add_argument(
        "--exchanges",
        nargs="+",
        default=["auto"],
        choices=["auto", "allgather", "split"],
        help="how top-k-type selections are combined, SparseDDPStrategy(exchange=...); other compressors "
        "run once (default: %(default)s)",
    )
    parser.add_argument(
        "--value-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the values the sparse runs send (default: the gradient's)",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=DEFAULT_PEERS,
        metavar="PEER",
        help=f"torch's DDP comm hooks as reference rows: {PEER_HELP}; bare powersgd: rank 4; "
        "none: --peers with no value (default: %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every run (default: the task's own)")
    parser.add_argument(
        "--limit-train-batches",
        type=int,
        default=None,
        metavar="N",
        help="train on N batches per epoch (default: the task's own; gpt: 100)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="gpt: a tiny model (width 32, 1 block, context 16) for smoke runs"
    )
    parser.add_argument("--devices", type=int, default=2, help="CPU processes per run (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data order")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense DDP run (no reference figures)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run (default: %(default)s)")
    parser.add_argument("--out", default="convergence_out", metavar="DIR", help="output folder (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the JSON here (default: OUT/...)")
    parser.add_argument(
        "--from-json",
        default=None,
        metavar="PATH",
        help="train nothing: write the table and plots of the runs in a convergence.json this command wrote",
    )


# ----------------------------------------------------------------------------------------------
# one fit (runs inside every rank of a worker subprocess)


class _Recorder(L.Callback):
    """Per validation: optimizer steps, the validation figures, and this rank's cumulative bytes.

    ``counter``: for torch's hooks, the collective counter; it counts during training batches only
    (validation's metric syncs are not gradient traffic).
    """

    def __init__(self, counter: CollectiveCounter | None = None) -> None:
        self.points: list[dict[str, float]] = []
        self.param_bytes = 0
        self.counter = counter

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)

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
        from lightning_sparse.patterns import ring_all_reduce_bytes

        state = getattr(trainer.strategy, "sparse_state", None)
        if state is not None and self.counter is None:
            return float(state.telemetry.total.wire_bytes)
        return ring_all_reduce_bytes(trainer.world_size, self.bytes_so_far(trainer)[0])

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
    """``SparseDDPStrategy`` of a sparse run, in the run's mode (runs without one compressed gradients)."""
    import lightning_sparse

    return lightning_sparse.SparseDDPStrategy(
        compress=config.get("mode") or "gradient",
        compressor=config["compressor"],
        density=config["density"],
        exchange=config.get("exchange") or "auto",
        value_dtype=config.get("value_dtype"),
        compression_monitor=False,
    )


def fit_run(config: dict[str, Any]) -> dict[str, Any] | None:
    """Train one run as ``config`` says; returns its figures on global rank 0, ``None`` elsewhere."""
    import torch

    torch.set_num_threads(1)  # N processes on N cores
    task = TASKS[config["task"]]
    L.seed_everything(config["seed"], verbose=False)
    model, data = task.build(config["seed"], bool(config.get("tiny")))
    counter: CollectiveCounter | None = None
    if config.get("peer"):
        state, hook = Peer.parse(config["peer"]).registered_hook()
        strategy: Any = CommHookDDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)
        counter = CollectiveCounter()
        counter.install()
    elif config["compressor"] is None:
        strategy = "ddp"
    else:
        strategy = _sparse_strategy(config)
    recorder = _Recorder(counter)
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
        callbacks=[recorder],
    )
    start = time.perf_counter()
    try:
        trainer.fit(model, datamodule=data)
    finally:
        if counter is not None:
            counter.uninstall()
    seconds = time.perf_counter() - start
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


# ----------------------------------------------------------------------------------------------
# the benchmark (main process): one subprocess per run


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kind(run: dict[str, Any]) -> str:
    """``"dense"``, ``"sparse"`` or ``"peer"`` (torch's hook)."""
    if run.get("peer"):
        return "peer"
    return "dense" if run["compressor"] is None else "sparse"


def _mode(run: dict[str, Any]) -> str:
    """A sparse run's mode; runs saved before modes existed compressed gradients."""
    return run.get("mode") or "gradient"


def run_label(run: dict[str, Any]) -> str:
    """The row label of a run: ``dense DDP``, ``topk (update)``, ``PowerSGD rank 4 (torch hook)``.

    Example:
        >>> run_label({"compressor": "topk", "density": 0.01, "mode": "update"})
        'topk (update)'
    """
    kind = _kind(run)
    if kind == "dense":
        return DENSE
    if kind == "peer":
        return Peer.parse(run["peer"]).label
    if run.get("mode") is None:
        return run["compressor"]
    extra = [run["mode"]]
    if run.get("exchange") not in (None, "auto"):
        extra.append(run["exchange"])
    if run.get("value_dtype") not in (None, "float32"):
        extra.append(f"{run['value_dtype']} values")
    return f"{run['compressor']} ({', '.join(extra)})"


def _run_name(config: dict[str, Any]) -> str:
    kind = _kind(config)
    if kind == "peer":
        tail = config["peer"]
    elif kind == "dense":
        tail = "dense_1"
    else:
        tail = f"{config['compressor']}_{config['density']:g}_{_mode(config)}"
        for key in ("exchange", "value_dtype"):
            if config.get(key) not in (None, "auto"):
                tail += f"_{config[key]}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{config['task']}_{tail}")


def launch(config: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    """Run one fit in a fresh process group; returns its figures, or ``status`` "failed"/"timeout"."""
    name = _run_name(config)
    cfg_path, log_path = workdir / f"{name}.json", workdir / f"{name}.log"
    config = {**config, "result": str(workdir / f"{name}.result.json")}
    cfg_path.write_text(json.dumps(config))
    env = dict(os.environ)
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK"):
        env.pop(key, None)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
    )
    cmd = [sys.executable, "-m", "lightning_sparse.bench.convergence", "--worker", str(cfg_path)]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # own session: on a timeout the whole group (rank 0 and the ranks it launched) is killed
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    wall = time.perf_counter() - start
    try:  # a rank that outlived rank 0 (a crash on one rank) would keep a core busy
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    result_path = Path(config["result"])
    if rc == 0 and result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace")[-3000:]
        status = "timeout" if rc is None else f"failed (exit code {rc})"
        print(f"  {name}: {status}; end of its output:\n{tail}", file=sys.stderr)
        result = {"status": status, "final_acc": None, "final_loss": None, "sent_bytes": 0, "points": []}
    result["process_seconds"] = wall
    return result


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ok(run: dict[str, Any]) -> bool:
    return run.get("status") == "ok"


def _metric_of(task: str, metric: Metric | None) -> Metric:
    if metric is not None:
        return metric
    return TASKS[task].metric if task in TASKS else ACCURACY


def _final(run: dict[str, Any], metric: Metric) -> float | None:
    return run.get(f"final_{metric.key}")


def _reference(runs: list[dict[str, Any]], metric: Metric = ACCURACY) -> tuple[float | None, float | None]:
    """(dense metric, dense bytes) of a task: its dense run's, else (None, another run's dense_bytes)."""
    dense = next((r for r in runs if _kind(r) == "dense" and _ok(r)), None)
    if dense is not None:
        return _final(dense, metric), float(dense["sent_bytes"])
    other = next((r for r in runs if _ok(r)), None)
    return None, (float(other["dense_bytes"]) if other else None)


def table(task: str, runs: list[dict[str, Any]], metric: Metric | None = None) -> list[str]:
    """A markdown table of one task's runs, judged by ``metric`` (default: the task's own; accuracy for
    names that are not tasks)."""
    metric = _metric_of(task, metric)
    ref, bytes0 = _reference(runs, metric)
    lines = [
        f"| run | density | final {metric.title} | vs dense ({metric.unit}) | bytes sent per rank "
        "| bytes reduction vs dense | wire bytes per rank | coordinates sent | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        kind = _kind(r)
        label = run_label(r)
        density = {"dense": "1", "peer": "-"}.get(kind) or f"{r['density']:g}"
        value = _final(r, metric) if _ok(r) else None
        if value is None:
            status = r["status"] if not _ok(r) else f"no {metric.logged}"
            lines.append(f"| {label} | {density} | {status} | - | - | - | - | - | - |")
            continue
        diff = "-" if ref is None else format(metric.diff(value, ref), metric.diff_format)
        reduction = f"{bytes0 / r['sent_bytes']:.1f}x" if bytes0 and r["sent_bytes"] else "-"
        coords = "-" if kind == "peer" else f"{r.get('coordinate_density', 1.0):.4f}"
        wire = _fmt_bytes(r["wire_bytes"]) if r.get("wire_bytes") is not None else "-"  # older results: absent
        lines.append(
            f"| {label} | {density} | {value:.4f} | {diff} | {_fmt_bytes(r['sent_bytes'])} | {reduction} "
            f"| {wire} | {coords} | {r['fit_seconds']:.1f} |"
        )
    return lines


def target_check(runs: list[dict[str, Any]], mode: str = "gradient") -> dict[str, Any]:
    """At ``TARGET_DENSITY`` and in ``mode``: top-k and the best other compressor, each within
    ``TARGET_POINTS`` accuracy points of dense with at least ``TARGET_REDUCTION`` x fewer bytes?

    The best other compressor is one that meets the target if any does (the most accurate of
    those, then the one sending fewest bytes), else the most accurate.
    """
    acc0, bytes0 = _reference(runs, ACCURACY)
    at = [
        r
        for r in runs
        if _kind(r) == "sparse" and _ok(r) and _mode(r) == mode and abs(r["density"] - TARGET_DENSITY) < 1e-12
    ]
    if acc0 is None or not bytes0 or not at:
        return {"checked": False}

    def verdict(r: dict[str, Any]) -> dict[str, Any]:
        points, reduction = ACCURACY.diff(r["final_acc"], acc0), bytes0 / r["sent_bytes"]
        met = points >= -TARGET_POINTS and reduction >= TARGET_REDUCTION
        return {"compressor": r["compressor"], "points": points, "reduction": reduction, "met": met}

    topk = next((r for r in at if r["compressor"] == "topk"), None)
    # the best other compressor: one that meets the target if any does; then the most accurate, then the fewest bytes
    others = [verdict(r) | {"acc": r["final_acc"], "sent": r["sent_bytes"]} for r in at if r["compressor"] != "topk"]
    best = max(others, key=lambda v: (v["met"], v["acc"], -v["sent"])) if others else None
    out: dict[str, Any] = {"checked": True, "mode": mode}
    if topk is not None:
        out["topk"] = verdict(topk)
    if best is not None:
        out["best_other"] = {key: best[key] for key in ("compressor", "points", "reduction", "met")}
    out["met"] = all(out[k]["met"] for k in ("topk", "best_other") if k in out)
    return out


def value_within_bytes(run: dict[str, Any], budget: float, metric: Metric) -> tuple[float, float] | None:
    """(metric, cumulative bytes) of ``run`` at its last validation that had sent at most ``budget`` bytes;
    ``None`` if even its first validation came after more.

    Example:
        >>> run = {"points": [{"loss": 2.0, "sent_bytes": 10}, {"loss": 1.5, "sent_bytes": 30}]}
        >>> value_within_bytes(run, 20, VAL_LOSS), value_within_bytes(run, 5, VAL_LOSS)
        ((2.0, 10), None)
    """
    within = [p for p in run.get("points", []) if p["sent_bytes"] <= budget and metric.key in p]
    return (within[-1][metric.key], within[-1]["sent_bytes"]) if within else None


def gpt_target_check(runs: list[dict[str, Any]], metric: Metric = VAL_LOSS) -> dict[str, Any]:
    """The gpt task's target, one entry per ``GPT_TARGETS`` density: update-mode top-k there better than
    the PowerSGD peer at equal or fewer bytes (its metric at its last validation with no more cumulative
    bytes than the peer sent over the whole fit, against the peer's final metric), and, where the entry
    has a tolerance, within it of dense (``GPT_TARGET_NATS`` at 0.01).

    Each entry: ``{"density", "peer", "checked", "met", ...}``, unchecked when a run is missing or failed.
    """
    ref, _ = _reference(runs, metric)
    entries = []
    for density, peer_name, tolerance in GPT_TARGETS:
        entry: dict[str, Any] = {"density": density, "peer": peer_name, "tolerance": tolerance, "checked": False}
        entries.append(entry)
        topk = next(
            (
                r
                for r in runs
                if _kind(r) == "sparse"
                and _ok(r)
                and r["compressor"] == "topk"
                and _mode(r) == "update"
                and abs(r["density"] - density) < 1e-12
            ),
            None,
        )
        peer = next(
            (r for r in runs if _kind(r) == "peer" and _ok(r) and Peer.parse(r["peer"]).name == peer_name), None
        )
        if topk is None or peer is None or _final(topk, metric) is None or _final(peer, metric) is None:
            continue
        if tolerance is not None and ref is None:
            continue
        at = value_within_bytes(topk, peer["sent_bytes"], metric)
        entry.update(
            checked=True,
            topk=_final(topk, metric),
            topk_bytes=topk["sent_bytes"],
            peer_value=_final(peer, metric),
            peer_bytes=peer["sent_bytes"],
            topk_at_peer_bytes=None if at is None else at[0],
        )
        beats = at is not None and metric.better(at[0], entry["peer_value"])
        entry["beats_peer"] = beats
        if tolerance is not None:
            entry["vs_dense"] = metric.diff(entry["topk"], ref)
            # "within tolerance" of dense: not worse by more than it, in the metric's better direction
            worse = -entry["vs_dense"] if metric.higher_is_better else entry["vs_dense"]
            entry["near_dense"] = worse <= tolerance
        entry["met"] = beats and entry.get("near_dense", True)
    checked = [e for e in entries if e["checked"]]
    return {
        "checked": bool(checked),
        "kind": "gpt",
        "entries": entries,
        "met": bool(checked) and len(checked) == len(entries) and all(e["met"] for e in entries),
    }


def _target_lines(check: dict[str, Any]) -> list[str]:
    if not check.get("checked"):
        return []
    if check.get("kind") == "gpt":
        return [_gpt_target_line(e) for e in check["entries"]]
    parts = [
        f"{v['compressor']} {v['points']:+.2f} points, {v['reduction']:.1f}x fewer bytes"
        for v in (check.get("topk"), check.get("best_other"))
        if v
    ]
    mode = "" if check.get("mode", "gradient") == "gradient" else f", {check['mode']} mode"
    return [
        f"Target at density {TARGET_DENSITY:g}{mode} (top-k and the best other compressor each within "
        f"{TARGET_POINTS:g} point of dense with >= {TARGET_REDUCTION:g}x fewer bytes): "
        f"{'met' if check['met'] else 'not met'} ({'; '.join(parts)})."
    ]


def _gpt_target_line(e: dict[str, Any]) -> str:
    peer = Peer.parse(e["peer"]).label
    goal = f"update-mode top-k at density {e['density']:g}"
    goal += f" within {e['tolerance']:g} nats of dense and" if e["tolerance"] is not None else ""
    goal += f" better than {peer} at equal or fewer bytes"
    if not e["checked"]:
        return f"Target: {goal}: not checked (a run is missing or failed)."
    at = e["topk_at_peer_bytes"]
    parts = []
    if e["tolerance"] is not None:
        parts.append(f"top-k {e['topk']:.3f} ({e['vs_dense']:+.3f} nats vs dense)")
    parts.append(
        f"top-k {'-' if at is None else f'{at:.3f}'} within {_fmt_bytes(e['peer_bytes'])} "
        f"(it sent {_fmt_bytes(e['topk_bytes'])} in all) vs {peer} {e['peer_value']:.3f}"
    )
    return f"Target: {goal}: {'met' if e['met'] else 'not met'} ({'; '.join(parts)})."


def _variant(run: dict[str, Any]) -> tuple[str, str, str]:
    return (run["compressor"], run.get("exchange") or "auto", run.get("value_dtype") or "")


def plot(task: str, runs: list[dict[str, Any]], path: Path, metric: Metric | None = None) -> bool:
    """The validation metric against cumulative bytes sent (log x), one panel per density; dense DDP and
    torch's hooks in every panel; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = _metric_of(task, metric)
    sparse = [r for r in runs if _kind(r) == "sparse"]
    densities = sorted({r["density"] for r in sparse}, reverse=True) or [1.0]
    # one color per compressor and way of sending (exchange, value dtype)
    compressors = list(dict.fromkeys(_variant(r) for r in sparse))
    modes = list(dict.fromkeys(_mode(r) for r in sparse))
    cmap = plt.get_cmap("tab10")
    colors = {c: cmap(i % 10) for i, c in enumerate(compressors)}
    # compressors that select the same coordinates (e.g. the exact top-k of topk, gaussiank and dgc)
    # draw the same curve: distinct dash patterns keep each of them visible; with several modes the
    # dash pattern tells the mode instead (update solid, gradient dashed)
    if len(modes) > 1:
        mode_styles = {"update": "-", "gradient": "--"}
        style = {(c, m): mode_styles.get(m, ":") for c in compressors for m in modes}
    else:
        style = {(c, m): ("-", "--", "-.", ":")[i % 4] for i, c in enumerate(compressors) for m in modes}
    references = [r for r in runs if _kind(r) in ("dense", "peer") and _ok(r) and r.get("points")]
    greys = ("black", "dimgray", "darkgray", "saddlebrown", "olive", "slategray")
    fig, axes = plt.subplots(1, len(densities), figsize=(5.2 * len(densities), 4.4), sharex=True, sharey=True)
    axes = list(axes) if len(densities) > 1 else [axes]
    for ax, density in zip(axes, densities, strict=True):
        for i, r in enumerate(references):
            pts = [p for p in r["points"] if metric.key in p]
            dense = _kind(r) == "dense"
            ax.plot(
                [p["sent_bytes"] for p in pts],
                [p[metric.key] for p in pts],
                color=greys[i % len(greys)],
                lw=2.2 if dense else 1.4,
                ls="-" if dense else ":",
                marker="o" if dense else "s",
                ms=3,
                label=run_label(r),
            )
        for r in sparse:
            if r["density"] != density or not r.get("points"):
                continue
            pts = [p for p in r["points"] if metric.key in p]
            c = _variant(r)
            ax.plot(
                [p["sent_bytes"] for p in pts],
                [p[metric.key] for p in pts],
                color=colors[c],
                ls=style[(c, _mode(r))],
                lw=1.5,
                marker="o",
                ms=2.5,
                label=run_label(r),
            )
        ax.set_xscale("log")
        ax.set_title(f"density {density:g}" if density < 1 else "dense")
        ax.set_xlabel("cumulative bytes sent per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(metric.axis or metric.title)
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="center right", frameon=False)
    fig.suptitle(f"{task}: {(metric.axis or metric.title).split(' (')[0]} vs bytes sent (error feedback on)")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    from lightning_sparse.compressors import COMPRESSORS

    for name in args.compressors:
        if name not in COMPRESSORS:
            raise ValueError(f"--compressors {name!r} is not allowed: expected names in {sorted(COMPRESSORS)}")
    for d in args.densities:
        if not 0 < d <= 1:
            raise ValueError(f"--densities {d!r} is not allowed: expected numbers in (0, 1]")
    peers = list(dict.fromkeys(Peer.parse(p).name for p in (getattr(args, "peers", None) or [])))
    modes = list(dict.fromkeys(getattr(args, "modes", None) or ["gradient"]))
    for flag, value, low in (
        ("--epochs", args.epochs, 1),
        ("--devices", args.devices, 1),
        ("--limit-train-batches", args.limit_train_batches, 1),
    ):
        if value is not None and value < low:
            raise ValueError(f"{flag}={value} is not allowed: expected an integer >= {low}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        return report(saved["runs"], saved["total_seconds"], saved["args"], saved["tasks"], out, args.json)
    started = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="convergence_") as tmp:
        for task_name in args.tasks:
            task = TASKS[task_name]
            base = {
                "task": task_name,
                "epochs": args.epochs or task.epochs,
                "limit_train_batches": args.limit_train_batches or task.limit_train_batches,
                "devices": args.devices,
                "seed": args.seed,
                "tiny": bool(getattr(args, "tiny", False)),
            }
            specs: list[dict[str, Any]] = [] if args.no_dense else [{"compressor": None, "density": 1.0}]
            specs += [{"compressor": None, "density": None, "peer": p} for p in peers]
            exchanges = list(dict.fromkeys(getattr(args, "exchanges", None) or ["auto"]))
            value_dtype = getattr(args, "value_dtype", None)
            specs += [
                {"compressor": c, "density": d, "mode": m, "exchange": e, "value_dtype": value_dtype}
                for d in args.densities
                for m in modes
                for c in args.compressors
                for e in (exchanges if COMPRESSORS[c].pattern == "gather" else ["auto"])
            ]
            results[task_name] = []
            for spec in specs:
                config = {**base, "mode": None, "peer": None, **spec}
                label = run_label(config)
                if _kind(config) == "sparse":
                    label = f"{config['compressor']} {config['density']:g} ({label.split(' (', 1)[1]}"
                print(f"[{task_name}] {label} ...", end=" ", flush=True)
                result = launch(config, Path(tmp), args.timeout)
                results[task_name].append({**config, **result})
                value = _final(result, task.metric)
                if _ok(result) and value is not None:
                    print(
                        f"{task.metric.title} {value:.4f}, {_fmt_bytes(result['sent_bytes'])} sent, "
                        f"{result['fit_seconds']:.1f} s",
                        flush=True,
                    )
                else:
                    print(result["status"], flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "from_json")}
    descriptions = {}
    for name in results:
        tiny = TASKS[name].tiny_description if getattr(args, "tiny", False) else None
        descriptions[name] = TASKS[name].description + (f" ({tiny})" if tiny else "")
    return report(results, time.perf_counter() - started, settings, descriptions, out, args.json)


def report(
    results: dict[str, list[dict[str, Any]]],
    total_s: float,
    settings: dict[str, Any],
    descriptions: dict[str, str],
    out: Path,
    json_path: str | None = None,
) -> int:
    """Print and write the tables, the JSON and the plots of ``results`` (task -> runs) of a run
    made with ``settings`` (the command's arguments) on tasks described by ``descriptions``."""
    md: list[str] = []
    checks: dict[str, Any] = {}
    devices, seed = settings["devices"], settings["seed"]
    for task_name, runs in results.items():
        task = TASKS[task_name]
        epochs = runs[0]["epochs"] if runs else task.epochs
        limit = runs[0].get("limit_train_batches") if runs else task.limit_train_batches
        length = f"{epochs} epochs" + (f" of {limit} batches" if limit else "")
        md += [
            f"### {task_name}",
            "",
            f"{descriptions[task_name]}; {length}, {devices} processes, seed {seed}, error feedback on.",
            "",
            *table(task_name, runs),
            "",
        ]
        if task.metric is ACCURACY:
            modes = list(dict.fromkeys(_mode(r) for r in runs if _kind(r) == "sparse"))
            checks[task_name] = {mode: target_check(runs, mode) for mode in modes}
        else:
            checks[task_name] = {"target": task.target(runs)}
        lines = [line for check in checks[task_name].values() for line in _target_lines(check)]
        md += [*lines, ""] if lines else []
    metrics = list(dict.fromkeys(TASKS[name].metric.title for name in results)) or [ACCURACY.title]
    md += [
        f"{' / '.join(m[0].upper() + m[1:] for m in metrics)}: after the last validation. Bytes: what rank 0 "
        "handed to torch.distributed over the whole fit (sparse runs: the strategy's telemetry; dense DDP: steps "
        "x parameter bytes; torch hooks: the tensors the hook gave to the collectives). "
        "Reduction: dense DDP bytes / bytes sent. Coordinates sent: fraction of gradient coordinates sent, "
        "dense parts (biases, the first step, dense fallbacks) counted in full. Wall s: trainer.fit on rank 0.",
        "",
        f"Total wall time: {total_s:.0f} s for {sum(len(r) for r in results.values())} runs.",
    ]
    text = "\n".join(md)
    print()
    print(text)
    (out / "convergence.md").write_text(text + "\n")
    payload = {
        "args": settings,
        "tasks": descriptions,
        "target": {
            "density": TARGET_DENSITY,
            "points": TARGET_POINTS,
            "reduction": TARGET_REDUCTION,
            "gpt": [{"density": d, "peer": p, "nats": n} for d, p, n in GPT_TARGETS],
        },
        "checks": checks,
        "total_seconds": total_s,
        "runs": results,
    }
    for path in {out / "convergence.json", Path(json_path) if json_path else out / "convergence.json"}:
        path.write_text(json.dumps(payload, indent=1))
    plotted = [plot(name, runs, out / f"convergence_{name}.png") for name, runs in results.items()]
    if not all(plotted):
        print('matplotlib is not installed: plots skipped (pip install "lightning_sparse[plot]")')
    else:
        print(f"wrote {out / 'convergence.md'}, {out / 'convergence.json'} and the plots convergence_<task>.png")
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
