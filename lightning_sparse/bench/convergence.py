"""Accuracy against bytes sent: dense DDP and each compressor at several densities, on real multi-process fits.

    python -m lightning_sparse.bench convergence                                  # everything, ~30-40 min on 2 cores
    python -m lightning_sparse.bench convergence --tasks text --compressors topk dgc --densities 0.01 --epochs 2

For each task (``digits``: an MLP on scikit-learn's handwritten digits; ``text``: a GRU predicting
the next character of Python standard-library source) it trains the same model from the same
initial weights and data order with dense DDP and with ``SparseDDPStrategy`` (error feedback on)
for every compressor and density: each run is a real ``lightning.Trainer(accelerator="cpu",
devices=N)`` fit, launched as its own subprocess (Lightning's popen launcher starts the other
ranks; gloo; one thread per process), so a hung rank times out instead of hanging the benchmark.

Bytes are what rank 0 handed to ``torch.distributed``: for sparse runs the strategy's telemetry
(values, indices, the dense small tensors, the dense first step, dense fallbacks); for dense DDP the
all-reduced gradients, optimizer steps x sum of parameter bytes, which is what the telemetry's
``dense_bytes`` counts too. The accuracy is the validation accuracy after the last epoch.

Writes to ``--out`` (default ``convergence_out``): ``convergence.md`` (one markdown table per
task), ``convergence.json`` (every run, with its accuracy after each validation against the bytes
sent until then) and ``convergence_<task>.png`` (validation accuracy against cumulative bytes sent,
log x axis; needs matplotlib: ``pip install "lightning_sparse[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

DEFAULT_DENSITIES = [0.1, 0.01, 0.001]
DENSE = "dense DDP"
#: the issue's target: at this density, within this many accuracy points of dense with at least this reduction
TARGET_DENSITY, TARGET_POINTS, TARGET_REDUCTION = 0.01, 1.0, 30.0


@dataclass(frozen=True)
class ConvergenceTask:
    """A model, its data and its training length, as the convergence benchmark trains it.

    Args:
        name: the task's name on the command line.
        description: one line for the tables.
        epochs: default number of epochs (``--epochs`` overrides it).
        build: ``build(seed) -> (LightningModule, LightningDataModule)``; the module logs ``val_acc``.

    Example:
        >>> task = TASKS["digits"]
        >>> task.epochs
        30
    """

    name: str
    description: str
    epochs: int
    build: Callable[[int], tuple[L.LightningModule, L.LightningDataModule]]


def _digits(seed: int) -> tuple[L.LightningModule, L.LightningDataModule]:
    from lightning_sparse.tasks import DigitsClassifier, DigitsDataModule

    return DigitsClassifier(), DigitsDataModule(batch_size=32, seed=0)


def _text(seed: int) -> tuple[L.LightningModule, L.LightningDataModule]:
    from lightning_sparse.tasks import NextCharClassifier, TextDataModule

    return NextCharClassifier(), TextDataModule(batch_size=64, seed=0)


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
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lightning_sparse.compressors import COMPRESSORS

    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="default: %(default)s")
    parser.add_argument(
        "--compressors", nargs="+", default=list(COMPRESSORS), help="compressor names (default: %(default)s)"
    )
    parser.add_argument("--densities", type=float, nargs="+", default=DEFAULT_DENSITIES, help="default: %(default)s")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every run (default: the task's own)")
    parser.add_argument(
        "--limit-train-batches", type=int, default=None, metavar="N", help="train on N batches per epoch (quick looks)"
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
    """Per validation: optimizer steps, validation accuracy, and this rank's cumulative bytes."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []
        self.param_bytes = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)

    def bytes_so_far(self, trainer: L.Trainer) -> tuple[int, int]:
        """(bytes sent, bytes plain DDP all-reduces) by this rank since the start of the fit."""
        state = getattr(trainer.strategy, "sparse_state", None)
        if state is None:  # dense DDP: every optimizer step all-reduces every gradient
            dense = trainer.global_step * self.param_bytes
            return dense, dense
        total = state.telemetry.total
        return int(total.sent_bytes), int(total.dense_bytes)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        sent, dense = self.bytes_so_far(trainer)
        self.points.append(
            {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                "acc": float(trainer.callback_metrics["val_acc"]),
                "sent_bytes": sent,
                "dense_bytes": dense,
            }
        )


def fit_run(config: dict[str, Any]) -> dict[str, Any] | None:
    """Train one run as ``config`` says; returns its figures on global rank 0, ``None`` elsewhere."""
    import torch

    import lightning_sparse

    torch.set_num_threads(1)  # N processes on N cores
    task = TASKS[config["task"]]
    L.seed_everything(config["seed"], verbose=False)
    model, data = task.build(config["seed"])
    if config["compressor"] is None:
        strategy: Any = "ddp"
    else:
        strategy = lightning_sparse.SparseDDPStrategy(
            compressor=config["compressor"], density=config["density"], compression_monitor=False
        )
    recorder = _Recorder()
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
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    if not trainer.is_global_zero:
        return None
    sent, dense = recorder.bytes_so_far(trainer)
    result: dict[str, Any] = {
        "status": "ok",
        "final_acc": recorder.points[-1]["acc"] if recorder.points else None,
        "steps": trainer.global_step,
        "sent_bytes": sent,
        "dense_bytes": dense,
        "param_bytes": recorder.param_bytes,
        "fit_seconds": seconds,
        "points": recorder.points,
    }
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
    return 0


# ----------------------------------------------------------------------------------------------
# the benchmark (main process): one subprocess per run


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    """Run one fit in a fresh process group; returns its figures, or ``status`` "failed"/"timeout"."""
    name = f"{config['task']}_{config['compressor'] or 'dense'}_{config['density']:g}"
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
    result_path = Path(config["result"])
    if rc == 0 and result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace")[-3000:]
        status = "timeout" if rc is None else f"failed (exit code {rc})"
        print(f"  {name}: {status}; end of its output:\n{tail}", file=sys.stderr)
        result = {"status": status, "final_acc": None, "sent_bytes": 0, "points": []}
    result["process_seconds"] = wall
    return result


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ok(run: dict[str, Any]) -> bool:
    return run.get("status") == "ok"


def _reference(runs: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(dense accuracy, dense bytes) of a task: its dense run's, else (None, a sparse run's dense_bytes)."""
    dense = next((r for r in runs if r["compressor"] is None and _ok(r)), None)
    if dense is not None:
        return dense["final_acc"], float(dense["sent_bytes"])
    sparse = next((r for r in runs if _ok(r)), None)
    return None, (float(sparse["dense_bytes"]) if sparse else None)


def table(task: str, runs: list[dict[str, Any]]) -> list[str]:
    """A markdown table of one task's runs."""
    acc0, bytes0 = _reference(runs)
    lines = [
        "| run | density | final accuracy | vs dense (points) | bytes sent per rank | bytes reduction vs dense "
        "| coordinates sent | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        label = DENSE if r["compressor"] is None else r["compressor"]
        density = "1" if r["compressor"] is None else f"{r['density']:g}"
        if not _ok(r):
            lines.append(f"| {label} | {density} | {r['status']} | - | - | - | - | - |")
            continue
        diff = "-" if acc0 is None else f"{100 * (r['final_acc'] - acc0):+.2f}"
        reduction = f"{bytes0 / r['sent_bytes']:.1f}x" if bytes0 and r["sent_bytes"] else "-"
        coords = f"{r.get('coordinate_density', 1.0):.4f}"
        lines.append(
            f"| {label} | {density} | {r['final_acc']:.4f} | {diff} | {_fmt_bytes(r['sent_bytes'])} | {reduction} "
            f"| {coords} | {r['fit_seconds']:.1f} |"
        )
    return lines


def target_check(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """At ``TARGET_DENSITY``: top-k and the best other compressor, each within ``TARGET_POINTS``
    accuracy points of dense with at least ``TARGET_REDUCTION`` x fewer bytes?

    The best other compressor is one that meets the target if any does (the most accurate of
    those, then the one sending fewest bytes), else the most accurate.
    """
    acc0, bytes0 = _reference(runs)
    at = [r for r in runs if r["compressor"] is not None and _ok(r) and abs(r["density"] - TARGET_DENSITY) < 1e-12]
    if acc0 is None or not bytes0 or not at:
        return {"checked": False}

    def verdict(r: dict[str, Any]) -> dict[str, Any]:
        points, reduction = 100 * (r["final_acc"] - acc0), bytes0 / r["sent_bytes"]
        met = points >= -TARGET_POINTS and reduction >= TARGET_REDUCTION
        return {"compressor": r["compressor"], "points": points, "reduction": reduction, "met": met}

    topk = next((r for r in at if r["compressor"] == "topk"), None)
    # the best other compressor: one that meets the target if any does; then the most accurate, then the fewest bytes
    others = [verdict(r) | {"acc": r["final_acc"], "sent": r["sent_bytes"]} for r in at if r["compressor"] != "topk"]
    best = max(others, key=lambda v: (v["met"], v["acc"], -v["sent"])) if others else None
    out: dict[str, Any] = {"checked": True}
    if topk is not None:
        out["topk"] = verdict(topk)
    if best is not None:
        out["best_other"] = {key: best[key] for key in ("compressor", "points", "reduction", "met")}
    out["met"] = all(out[k]["met"] for k in ("topk", "best_other") if k in out)
    return out


def _target_line(check: dict[str, Any]) -> str:
    if not check.get("checked"):
        return ""
    parts = [
        f"{v['compressor']} {v['points']:+.2f} points, {v['reduction']:.1f}x fewer bytes"
        for v in (check.get("topk"), check.get("best_other"))
        if v
    ]
    return (
        f"Target at density {TARGET_DENSITY:g} (top-k and the best other compressor each within "
        f"{TARGET_POINTS:g} point of dense with >= {TARGET_REDUCTION:g}x fewer bytes): "
        f"{'met' if check['met'] else 'not met'} ({'; '.join(parts)})."
    )


def plot(task: str, runs: list[dict[str, Any]], path: Path) -> bool:
    """Validation accuracy against cumulative bytes sent (log x), one panel per density; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    densities = sorted({r["density"] for r in runs if r["compressor"] is not None}, reverse=True) or [1.0]
    compressors = list(dict.fromkeys(r["compressor"] for r in runs if r["compressor"] is not None))
    cmap = plt.get_cmap("tab10")
    colors = {c: cmap(i % 10) for i, c in enumerate(compressors)}
    # compressors that select the same coordinates (e.g. the exact top-k of topk, gaussiank and dgc)
    # draw the same curve: distinct dash patterns keep each of them visible
    styles = {c: ("-", "--", "-.", ":")[i % 4] for i, c in enumerate(compressors)}
    dense = next((r for r in runs if r["compressor"] is None and _ok(r)), None)
    fig, axes = plt.subplots(1, len(densities), figsize=(5.2 * len(densities), 4.4), sharex=True, sharey=True)
    axes = list(axes) if len(densities) > 1 else [axes]
    for ax, density in zip(axes, densities, strict=True):
        if dense is not None and dense["points"]:
            xs = [p["sent_bytes"] for p in dense["points"]]
            ax.plot(xs, [p["acc"] for p in dense["points"]], color="black", lw=2.2, label=DENSE)
        for r in runs:
            if r["compressor"] is None or r["density"] != density or not r.get("points"):
                continue
            xs = [p["sent_bytes"] for p in r["points"]]
            c = r["compressor"]
            ax.plot(xs, [p["acc"] for p in r["points"]], color=colors[c], ls=styles[c], lw=1.5, label=c)
        ax.set_xscale("log")
        ax.set_title(f"density {density:g}" if density < 1 else "dense")
        ax.set_xlabel("cumulative bytes sent per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("validation accuracy")
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="center right", frameon=False)
    fig.suptitle(f"{task}: validation accuracy vs bytes sent (error feedback on)")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
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
            epochs = args.epochs or task.epochs
            specs: list[tuple[str | None, float]] = [] if args.no_dense else [(None, 1.0)]
            specs += [(c, d) for d in args.densities for c in args.compressors]
            results[task_name] = []
            for compressor, density in specs:
                config = {
                    "task": task_name,
                    "compressor": compressor,
                    "density": density,
                    "epochs": epochs,
                    "limit_train_batches": args.limit_train_batches,
                    "devices": args.devices,
                    "seed": args.seed,
                }
                label = DENSE if compressor is None else f"{compressor} {density:g}"
                print(f"[{task_name}] {label} ...", end=" ", flush=True)
                result = launch(config, Path(tmp), args.timeout)
                results[task_name].append({**config, **result})
                if _ok(result):
                    print(
                        f"accuracy {result['final_acc']:.4f}, {_fmt_bytes(result['sent_bytes'])} sent, "
                        f"{result['fit_seconds']:.1f} s",
                        flush=True,
                    )
                else:
                    print(result["status"], flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "from_json")}
    descriptions = {name: TASKS[name].description for name in results}
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
        epochs = runs[0]["epochs"] if runs else TASKS[task_name].epochs
        md += [
            f"### {task_name}",
            "",
            f"{descriptions[task_name]}; {epochs} epochs, {devices} processes, seed {seed}, error feedback on.",
            "",
            *table(task_name, runs),
            "",
        ]
        checks[task_name] = target_check(runs)
        if checks[task_name].get("checked"):
            md += [_target_line(checks[task_name]), ""]
    md += [
        "Accuracy: validation accuracy after the last epoch. Bytes: what rank 0 handed to torch.distributed "
        "over the whole fit (sparse runs: the strategy's telemetry; dense DDP: steps x parameter bytes). "
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
        "target": {"density": TARGET_DENSITY, "points": TARGET_POINTS, "reduction": TARGET_REDUCTION},
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
