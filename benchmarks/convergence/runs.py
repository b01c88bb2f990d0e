"""A run as the convergence benchmark records it: the metric it is judged by, its kind, label and
reference figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.peers import Peer

DENSE = "dense DDP"


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


#: reference rows the benchmark builds itself: ``diloco:H`` (this library at density 1 with the Nesterov outer
#: step, which tests/test_local_steps.py checks against DiLoCo written out), ``torchft:H`` (DiLoCo of the
#: torchft package) and ``demo`` (DeMo, the optimizer of the pytorch-optimizer package, each rank's
#: gradients kept local)
LIBRARY_PEERS = ("diloco", "torchft", "demo")
#: what ``--variants`` may set, and the strategy argument each sets
VARIANT_KEYS = {
    "sync_every": "sync_every",
    "outer": "outer_optimizer",
    "value_bits": "value_bits",
    "warmup": "warmup_steps",
    "shard": "shard_size",  # with --shard-size: 0 runs sparse_ddp on the same processes
    "density": "density",  # this variant's density in place of --densities' (e.g. one low-density row)
    "density_start": "density_start",  # a density warm-up (WarmupDensity) from this to the run's density
    "density_steps": "density_steps",  # its length in optimizer steps (default 40)
    "delay": "sync_delay",  # apply each exchange this many optimizer steps after its launch
    "fragments": "fragments",  # exchange the parameters in this many staggered fragments
    "split": "fragment_split",  # how: strided (the default) or contiguous (module order)
    "flush": "flush_at_end",  # the end-of-fit hand-over: 0 none, R that many exchanges (default: exact)
    "ef_decay": "error_feedback_decay",  # SparseLoCo's decayed error feedback (default 1: none)
    "outer_momentum": "outer_momentum",  # the Nesterov outer step's momentum (default: DiLoCo's 0.9)
    "outer_lr": "outer_lr",  # the Nesterov outer step's learning rate (default: DiLoCo's 0.7)
    "bn_warmup": "batchnorm_warmup",  # a BatchNorm model's density warm-up in steps (0: off; default 40)
}
_FLOAT_KEYS = {"density", "density_start", "ef_decay", "outer_momentum", "outer_lr"}
_TEXT_KEYS = {"outer", "split"}


def parse_variant(spec: str) -> dict[str, Any]:
    """``"sync_every=16,outer=nesterov,value_bits=2"`` -> strategy arguments.

    Example:
        >>> parse_variant("sync_every=4,value_bits=2")
        {'sync_every': 4, 'value_bits': 2}
        >>> parse_variant("sync_every=4,density_start=0.1")
        {'sync_every': 4, 'density_start': 0.1}
        >>> parse_variant("density=0.0025")
        {'density': 0.0025}
        >>> parse_variant("sync_every=4,delay=1,fragments=4")
        {'sync_every': 4, 'sync_delay': 1, 'fragments': 4}
        >>> parse_variant("sync_every=4,flush=16"), parse_variant("flush=0")
        ({'sync_every': 4, 'flush_at_end': 16}, {'flush_at_end': False})
        >>> parse_variant("")
        {}
    """
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        if key not in VARIANT_KEYS or not value:
            raise ValueError(f"--variants {spec!r} is not allowed: expected key=value pairs of {sorted(VARIANT_KEYS)}")
        out[VARIANT_KEYS[key]] = value if key in _TEXT_KEYS else float(value) if key in _FLOAT_KEYS else int(value)
    if out.get("flush_at_end") == 0:
        out["flush_at_end"] = False
    return out


def library_peer(spec: str) -> dict[str, Any]:
    """The run of a ``diloco:H``, ``torchft:H`` or ``demo`` reference row."""
    kind, _, arg = spec.partition(":")
    if kind == "torchft":
        h = int(arg or 16)
        return {"compressor": None, "density": None, "peer": None, "torchft": h, "label": f"DiLoCo H={h} (torchft)"}
    if kind == "diloco":
        h = int(arg or 16)
        return {
            "compressor": "topk",
            "density": 1.0,
            "mode": "update",
            "sync_every": h,
            "outer_optimizer": "nesterov",
            "label": f"DiLoCo H={h} (density 1, Nesterov 0.7/0.9)",
        }
    return {"compressor": None, "density": None, "peer": None, "demo": True, "label": "DeMo (pytorch-optimizer)"}


def _kind(run: dict[str, Any]) -> str:
    """``"dense"``, ``"sparse"`` or ``"peer"`` (torch's hook, or a reference row built here)."""
    if run.get("peer") or run.get("demo") or run.get("torchft") or (run.get("label") and run.get("compressor")):
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
    if run.get("label"):
        return str(run["label"])
    if kind == "dense":
        return f"dense HSDP (groups of {run['shard_size']})" if run.get("shard_size") else DENSE
    if kind == "peer":
        return Peer.parse(run["peer"]).label
    if run.get("mode") is None:
        return run["compressor"]
    extra = [run["mode"]]
    if run.get("exchange") not in (None, "auto"):
        extra.append(run["exchange"])
    if run.get("value_dtype") not in (None, "float32"):
        extra.append(f"{run['value_dtype']} values")
    if run.get("sync_every", 1) != 1:
        extra.append(f"every {run['sync_every']} steps")
    if run.get("outer_optimizer"):
        settings = [f"{k} {run[f'outer_{k}']:g}" for k in ("lr", "momentum") if run.get(f"outer_{k}") is not None]
        extra.append(f"{run['outer_optimizer']} outer" + (f" ({', '.join(settings)})" if settings else ""))
    if run.get("value_bits"):
        extra.append(f"{run['value_bits']}-bit values")
    if run.get("warmup_steps") is not None:
        extra.append(f"{run['warmup_steps']} warm-up")
    if run.get("fragments", 1) != 1:
        extra.append(f"{run['fragments']} {run.get('fragment_split', 'strided')} fragments")
    if run.get("sync_delay"):
        extra.append(f"applied {run['sync_delay']} step{'s' if run['sync_delay'] > 1 else ''} later")
    if run.get("density_start"):
        extra.append(f"density from {run['density_start']:g} over {run.get('density_steps', 40)} steps")
    if run.get("error_feedback_decay", 1) != 1:
        extra.append(f"error feedback decayed by {run['error_feedback_decay']:g}")
    if "batchnorm_warmup" in run:
        warm = run["batchnorm_warmup"]
        extra.append(f"BatchNorm warm-up {warm} steps" if warm else "no BatchNorm warm-up")
    if run.get("flush_at_end") is False:
        extra.append("no hand-over")
    elif run.get("flush_at_end") is not None and run["flush_at_end"] is not True:  # (1 == True: compare identity)
        rounds = run["flush_at_end"]
        extra.append(f"hand-over in {rounds} exchange{'s' if rounds != 1 else ''}")
    if run.get("shard_size"):
        extra.append(f"sparse_fsdp, groups of {run['shard_size']}")
    elif run.get("shard_size") == 0:
        extra.append("sparse_ddp")
    return f"{run['compressor']} ({', '.join(extra)})"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ok(run: dict[str, Any]) -> bool:
    return run.get("status") == "ok"


def _final(run: dict[str, Any], metric: Metric) -> float | None:
    return run.get(f"final_{metric.key}")


def _reference(runs: list[dict[str, Any]], metric: Metric = ACCURACY) -> tuple[float | None, float | None]:
    """(dense metric, dense bytes) of a task: its dense run's, else (None, another run's dense_bytes)."""
    dense = next((r for r in runs if _kind(r) == "dense" and _ok(r)), None)
    if dense is not None:
        return _final(dense, metric), float(dense["sent_bytes"])
    other = next((r for r in runs if _ok(r)), None)
    return None, (float(other["dense_bytes"]) if other else None)
