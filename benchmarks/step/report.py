"""The step benchmark's report: the rows of the runs that could not be timed and the markdown table."""

from __future__ import annotations

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


def format_table(result: dict[str, Any]) -> str:
    """The figures as a markdown table, with a header line saying what was measured."""
    lines = [
        f"step time: {result['world_size']} ranks on {result['link']}; MLP {result['layers']} x "
        f"{result['width']}^2 = {result['params'] / 1e6:.1f}M parameters, batch {result['batch_size']} per rank, "
        f"{result['threads']} torch thread(s) per rank; density {result['density']:g}; "
        f"fallback_to_dense {FALLBACKS[result.get('fallback', 'bytes')]!r}; median and mean of "
        f"{result['steps']} steps after {result['warmup']} untimed; torch {result['torch']}",
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
