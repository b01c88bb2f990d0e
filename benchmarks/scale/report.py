"""The scale benchmark's report: the targets with their verdicts, and the markdown table."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.scale.model import COLUMNS, CONFIGS, DENSE, LINKS, link_seconds
from lightning_sparse.wire import MessageLayout

HEADERS = {
    DENSE: "dense MB",
    "allgather int32": "allgather int32",
    "allgather compact": "allgather compact",
    "split int32": "split int32",
    "split compact": "split compact",
    "auto": "auto (compact, defaults)",
    "auto bf16": "auto, bf16 values",
}
TARGET_W = 64
TARGET_FRACTION = 1 / 15
TARGET_BYTES_PER_COORD = 3.5
TARGET_SPLIT_W = 8
TARGET_SPLIT_RATIO = 0.4


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, each with its figure and outcome."""
    model = result["model"]["rows"]
    measure_rows = result["measure_model"]["rows"] + result["measured"]
    out = []
    worst = max(r["bytes"]["auto"] / r["bytes"][DENSE] for r in model + measure_rows)
    out.append(
        {
            "name": "a",
            "text": f"top-k {result['density']:g} with exchange='auto' (defaults) never moves more wire bytes than "
            f"dense, W = 2 .. {max(r['world'] for r in model)}",
            "value": f"largest auto / dense: {worst:.3f}",
            "passed": worst <= 1.0,
        }
    )
    at = next((r for r in model if r["world"] == TARGET_W), None)
    if at is not None:
        ratio = at["bytes"]["auto"] / at["bytes"][DENSE]
        out.append(
            {
                "name": "b",
                "text": f"at W = {TARGET_W}, auto moves at most 1/{1 / TARGET_FRACTION:g} of dense's wire bytes",
                "value": f"auto / dense = {ratio:.4f} (1/{1 / ratio:.1f})",
                "passed": ratio <= TARGET_FRACTION,
            }
        )
    largest = max(result["model"]["size"]["buckets"], key=lambda b: b["sparse_numel"])
    n, k = largest["sparse_numel"], largest["k"]
    per_coord = MessageLayout(n, k, torch.bfloat16, compact=True).size / k
    out.append(
        {
            "name": "c",
            "text": f"compact indices + bf16 values cost at most {TARGET_BYTES_PER_COORD:g} bytes per sent coordinate "
            f"(all-gather message of the largest bucket: n = {n:,}, k = {k:,})",
            "value": f"{per_coord:.3f} bytes per coordinate",
            "passed": per_coord <= TARGET_BYTES_PER_COORD,
        }
    )
    row = next((r for r in result["measured"] if r["world"] == TARGET_SPLIT_W), None)
    source = "measured"
    if row is None:
        row = next((r for r in result["measure_model"]["rows"] if r["world"] == TARGET_SPLIT_W), None)
        source = f"model: {TARGET_SPLIT_W} not in --world-sizes"
    if row is not None:
        ratios = {c: row["bytes"][f"split {c}"] / row["bytes"][f"allgather {c}"] for c in ("int32", "compact")}
        out.append(
            {
                "name": "d",
                "text": f"split on {TARGET_SPLIT_W} ranks moves at most {TARGET_SPLIT_RATIO:g}x the wire bytes of "
                f"allgather ({source})",
                "value": ", ".join(f"{c} {v:.3f}x" for c, v in ratios.items()),
                "passed": all(v <= TARGET_SPLIT_RATIO for v in ratios.values()),
            }
        )
    return out


def _mb(nbytes: float) -> str:
    mb = nbytes / 1e6
    return f"{mb:.1f}" if mb >= 100 else f"{mb:.3f}" if mb >= 0.1 else f"{mb:.4f}"


def _sent_as(how: list[str]) -> str:
    counts = {h: how.count(h) for h in dict.fromkeys(how)}
    return ", ".join(f"{n} {h}" for h, n in counts.items())


def _buckets(size: dict[str, Any]) -> str:
    n = len(size["size"]["buckets"])
    return f"{n} bucket{'s' if n > 1 else ''}"


def format_table(result: dict[str, Any]) -> str:
    """The figures as one markdown table, then the targets."""
    big, small = result["model"], result["measure_model"]
    lines = [
        f"wire bytes per rank per step (ring model; measured: the hook's telemetry on gloo); top-k density "
        f"{result['density']:g}; MLP of {result['layers']} square layers in buckets of at most "
        f"{result['bucket_mb']:g} MiB: {big['size']['params'] / 1e6:.2f}M parameters "
        f"({_buckets(big)}) and {small['size']['params'] / 1e6:.2f}M ({_buckets(small)}); "
        f"cells: MB (ratio to dense); torch {result['torch']}",
        "",
        "| W | figures | params | " + " | ".join(HEADERS[c] for c in COLUMNS) + " | auto sends buckets as |",
        "| ---: | --- | ---: | " + " | ".join("---:" for _ in COLUMNS) + " | --- |",
    ]
    measured = {r["world"]: r for r in result["measured"]}
    small_rows = {r["world"]: r for r in small["rows"]}

    def line(row: dict[str, Any], source: str, params: int, sent_as: list[str] | None) -> str:
        dense = row["bytes"][DENSE]
        cells = [_mb(dense)] + [f"{_mb(row['bytes'][c])} ({row['bytes'][c] / dense:.3g}x)" for c in CONFIGS]
        how = _sent_as(sent_as) if sent_as is not None else "-"
        return f"| {row['world']} | {source} | {params / 1e6:.2f}M | " + " | ".join(cells) + f" | {how} |"

    for row in big["rows"]:
        w = row["world"]
        if w in measured:
            lines.append(line(measured[w], "measured", small["size"]["params"], small_rows[w]["sent_as"]["auto"]))
            lines.append(line(small_rows[w], "model", small["size"]["params"], small_rows[w]["sent_as"]["auto"]))
        lines.append(line(row, "model", big["size"]["params"], row["sent_as"]["auto"]))
    lines += ["", *format_links(big), "", "targets:"]
    for t in result["targets"]:
        lines.append(f"- ({t['name']}) {'PASS' if t['passed'] else 'FAIL'}: {t['text']}: {t['value']}")
    return "\n".join(lines)


def format_links(model: dict[str, Any]) -> list[str]:
    """A step's exchange in seconds on each link of :data:`LINKS` (``collectives x round trip + wire
    bytes / bandwidth``), dense DDP against the defaults (auto) were every bucket to issue its own
    collectives (a comparison) and as they run, with every bucket's together (both modes)."""
    names = [name for name, _, _ in LINKS]
    lines = [
        f"seconds per step's exchange on a link (collectives x round trip + wire bytes / bandwidth; "
        f"{model['size']['params'] / 1e6:.2f}M parameters in {len(model['size']['buckets'])} buckets); "
        "columns: dense / auto, were each bucket to issue its own collectives / auto, every bucket's together",
        "",
        "| W | " + " | ".join(names) + " |",
        "| ---: | " + " | ".join("---" for _ in names) + " |",
    ]
    for row in model["rows"]:
        cells = []
        for _, bandwidth, round_trip in LINKS:
            dense = link_seconds(row, DENSE, bandwidth, round_trip, update=False)
            per_bucket = link_seconds(row, "auto", bandwidth, round_trip, update=False)
            together = link_seconds(row, "auto", bandwidth, round_trip, update=True)
            cells.append(f"{dense:.3f} / {per_bucket:.3f} / {together:.3f}")
        lines.append(f"| {row['world']} | " + " | ".join(cells) + " |")
    return lines
