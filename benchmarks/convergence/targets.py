"""The benchmark's targets: what each task's runs must show, checked on their figures, and the
lines that report the verdicts."""

from __future__ import annotations

from typing import Any

from benchmarks.convergence.runs import (
    ACCURACY,
    VAL_LOSS,
    Metric,
    _final,
    _fmt_bytes,
    _kind,
    _mode,
    _ok,
    _reference,
)
from benchmarks.peers import Peer

#: the accuracy tasks' target: at this density, within this many accuracy points of dense with at least this reduction
TARGET_DENSITY, TARGET_POINTS, TARGET_REDUCTION = 0.01, 1.0, 30.0
#: the gpt task's target: update-mode top-k at 0.01 within this many nats of dense and better than PowerSGD
#: rank 4 at equal or fewer bytes; at 0.001 better than PowerSGD rank 1
GPT_TARGET_NATS = 0.15
GPT_TARGETS = ((0.01, "powersgd:4", GPT_TARGET_NATS), (0.001, "powersgd:1", None))


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
        peer = next((r for r in runs if r.get("peer") and _ok(r) and Peer.parse(r["peer"]).name == peer_name), None)
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
        if tolerance is not None and ref is not None:  # (ref is None with a tolerance: skipped above)
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
