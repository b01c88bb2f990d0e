"""The convergence benchmark's results: a table per task, the targets' verdicts, the JSON and the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.convergence.plots import plot
from benchmarks.convergence.runs import (
    ACCURACY,
    Metric,
    _final,
    _fmt_bytes,
    _kind,
    _mode,
    _ok,
    _reference,
    run_label,
)
from benchmarks.convergence.targets import (
    GPT_TARGETS,
    TARGET_DENSITY,
    TARGET_POINTS,
    TARGET_REDUCTION,
    _target_lines,
    target_check,
)
from benchmarks.convergence.tasks import TASKS, _metric_of


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
