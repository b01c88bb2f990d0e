"""The step benchmark's report: the rows of the runs that could not be timed and the markdown table."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.step.options import DENSE, FALLBACKS


def failed_row(name: str, status: str) -> dict[str, Any]:
    """The table row of a run that could not be timed."""
    return {
        "name": name,
        "status": f"failed: {status}",
        "median_s": None,
        "mean_s": None,
        "times_s": [],
        "bytes_per_step": None,
        "compression_ratio": None,
        "hook_ms": None,
        "buckets": None,
        "dense_buckets": None,
        "wire_bytes_per_step": None,
    }


def _setup(result: dict[str, Any]) -> str:
    """What was measured: the ranks, the link, the model, the batch and the sparse runs' settings."""
    return (
        f"{result['world_size']} ranks on {result['link']}; MLP {result['layers']} x "
        f"{result['width']}^2 = {result['params'] / 1e6:.1f}M parameters, batch {result['batch_size']} per rank, "
        f"{result['threads']} torch thread(s) per rank; density {result['density']:g}; "
        f"fallback_to_dense {FALLBACKS[result.get('fallback', 'bytes')]!r}"
    )


def format_table(result: dict[str, Any]) -> str:
    """The figures as a markdown table, with a header line saying what was measured."""
    lines = [
        f"step time: {_setup(result)}; median and mean of {result['steps']} steps after {result['warmup']} "
        f"untimed; torch {result['torch']}",
        "",
        "| run | median step s | mean step s | dense / run (means) | MB sent per rank per step "
        "| MB on the wire per rank per step | peak MB of one step | compression ratio | hook ms per step "
        "| buckets sent dense | status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    dense_row = next((r for r in result["runs"] if r["name"] == DENSE), None)
    dense = None if dense_row is None else dense_row.get("mean_s", dense_row["median_s"])
    for r in result["runs"]:
        status = r.get("status", "ok")
        if r["median_s"] is None:  # a run that could not be timed (a peer that failed its probe)
            lines.append(f"| {r['name']} | - | - | - | - | - | - | - | - | - | {status} |")
            continue
        mean = r.get("mean_s", r["median_s"])  # absent in figures saved before it was measured
        ratio = f"{dense / mean:.2f}x" if dense else "-"
        peak = r.get("peak_step_wire_bytes")
        peak_mb = "-" if peak is None else f"{peak / 1e6:.2f}"
        hook = "-" if r["hook_ms"] is None else f"{r['hook_ms']:.1f}"
        comp = "-" if r["compression_ratio"] is None else f"{r['compression_ratio']:.1f}x"
        fallback = "-" if r["dense_buckets"] is None else f"{r['dense_buckets']}/{r['buckets']}"
        wire = r.get("wire_bytes_per_step")  # absent in figures saved before it was measured
        wire_mb = "-" if wire is None else f"{wire / 1e6:.2f}"
        lines.append(
            f"| {r['name']} | {r['median_s']:.3f} | {mean:.3f} | {ratio} | {r['bytes_per_step'] / 1e6:.2f} | {wire_mb} "
            f"| {peak_mb} | {comp} | {hook} | {fallback} | {status} |"
        )
    floor = result.get("unshaped_dense_mean_s") or next(
        (r.get("unshaped_mean_s") for r in result["runs"] if r["name"] == DENSE), None
    )
    if any(r.get("unshaped_mean_s") for r in result["runs"]):
        lines += [
            "",
            "mean step on this link against the same run on the unshaped loopback, in the same invocation"
            + (f" (unshaped dense DDP, the compute floor: {floor:.3f} s):" if floor else ":"),
            "",
            "| run | mean step s | unshaped mean step s | link / unshaped | link / unshaped dense "
            "| unshaped: dense / run |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in result["runs"]:
            mean, base = r.get("mean_s"), r.get("unshaped_mean_s")
            if mean is None or base is None:
                continue
            vs_floor = f"{mean / floor:.2f}x" if floor else "-"
            speed = f"{floor / base:.2f}x" if floor else "-"
            lines.append(f"| {r['name']} | {mean:.3f} | {base:.3f} | {mean / base:.2f}x | {vs_floor} | {speed} |")
    timed = [(r["name"], r["timed_fallback"][-1]) for r in result["runs"] if r.get("timed_fallback")]
    if timed:
        lines += ["", "timed fallback (median exchange window of the trial steps, slowest rank):"]
        lines += [
            f"- {name}: sparse {1e3 * d['sparse_s']:.1f} ms, dense {1e3 * d['dense_s']:.1f} ms -> {d['choice']}"
            for name, d in timed
        ]
    return "\n".join(lines)


def old_new_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run, the figures of the launches under the old code (``old``: their results) and under the new
    (``new``): each launch's median step, the median of those, new / old (below 1: the new code is faster)
    and the median bytes each rank sent per step.

    Example:
        >>> launch = lambda s: {"runs": [{"name": "topk", "median_s": s, "bytes_per_step": 8.0}]}
        >>> row, = old_new_rows([launch(2.0), launch(4.0)], [launch(1.5), launch(1.5)])
        >>> row["old_s"], row["new_s"], row["new_over_old"], row["new_bytes_per_step"]
        (3.0, 1.5, 0.5, 8.0)
    """
    names = list(dict.fromkeys(r["name"] for result in (*old, *new) for r in result["runs"]))
    rows = []
    for name in names:
        row: dict[str, Any] = {"name": name}
        for side, results in (("old", old), ("new", new)):
            found = [r for result in results for r in result["runs"] if r["name"] == name and r["median_s"] is not None]
            row[f"{side}_launches_s"] = [r["median_s"] for r in found]
            row[f"{side}_s"] = statistics.median(row[f"{side}_launches_s"]) if found else None
            row[f"{side}_bytes_per_step"] = statistics.median(r["bytes_per_step"] for r in found) if found else None
        row["new_over_old"] = None if not row["old_s"] or row["new_s"] is None else row["new_s"] / row["old_s"]
        rows.append(row)
    return rows


def format_old_new(commit: str, old: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
    """The figures of the launches under the package at ``commit`` (``old``) and under the working tree's
    (``new``) as a markdown table, one row per run, with a header line saying what was measured."""
    first = new[0]
    lines = [
        f"step time under the package at {commit[:7]} (old) and the working tree's (new), {len(old)} launches of "
        f"each, alternating: {_setup(first)}; per launch the median of {first['steps']} steps after "
        f"{first['warmup']} untimed, then the median over the launches; torch {first['torch']}",
        "",
        "| run | old median step s | new median step s | new / old | old MB sent per rank per step "
        "| new MB sent per rank per step | launches' medians s, old; new |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def figure(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
        return "-" if value is None else f"{value / scale:.{digits}f}"

    for r in old_new_rows(old, new):
        launches = "; ".join(", ".join(f"{t:.3f}" for t in r[f"{side}_launches_s"]) or "-" for side in ("old", "new"))
        ratio = "-" if r["new_over_old"] is None else f"{r['new_over_old']:.2f}"
        lines.append(
            f"| {r['name']} | {figure(r['old_s'])} | {figure(r['new_s'])} | {ratio} "
            f"| {figure(r['old_bytes_per_step'], 1e6, 2)} | {figure(r['new_bytes_per_step'], 1e6, 2)} | {launches} |"
        )
    return "\n".join(lines)
