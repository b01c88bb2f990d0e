"""Wire bytes per rank per step against the number of ranks: dense, all-gather and split exchanges.

    python -m lightning_sparse.bench scale
    python -m lightning_sparse.bench scale --params 25e6 --measure-params 2e6 --world-sizes 2 4 8
    python -m lightning_sparse.bench scale --json scale.json --plot wire_bytes.png

The model is a layer set like the step benchmark's: an MLP of ``--layers`` square Linear layers
(weight and bias each) holding about ``--params`` parameters, grouped into DDP-like buckets of at
most ``--bucket-mb`` MiB in reverse order (a tensor above the cap gets a bucket of its own). Top-k
at ``--density`` picks ``k_for(numel, density)`` coordinates of each tensor; tensors below
``min_numel`` (the biases of layers narrower than that) go dense. Each configuration's bytes
through one rank per optimizer step come from the package's own ring model, bucket by bucket:

- dense: ``ring_all_reduce_bytes`` of the bucket;
- allgather / split (int32 or compact indices): ``GATHER.choose`` for the sparse
  members plus the ring all-reduce of the dense members (no byte fallback: the exchange's own cost);
- auto (the defaults of ``SparseState``: compact indices, the byte fallback on), and auto with
  bfloat16 values: the exchange ``choose`` picks, and the whole bucket dense where the hook's byte
  rule finds the sparse exchange no cheaper than dense.

Measured: for each of ``--world-sizes`` it starts that many processes (gloo over 127.0.0.1, one
torch thread each) that build the same buckets as real tensors at ``--measure-params`` parameters
and, per configuration, run one dense warm-up step and one sparse step of random gradients through
the hook's ``communicate``; the wire bytes are the hook's telemetry of the sparse step
(``Counters.wire_bytes``: counted from the messages handed to each collective). The benchmark
checks that every rank reports the same figures and that they equal the model's for the same
size (relative difference at most 1e-9), and raises otherwise.

It prints one markdown table (MB per rank per step and the ratio to dense) and checks the targets;
the exit code is 1 when one of them fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from lightning_sparse._utils import end_process_group, free_port
from lightning_sparse.bench._ranks import run_ranks
from lightning_sparse.bench.step.worker import model_shape
from lightning_sparse.hook import communicate, sparse_is_cheaper
from lightning_sparse.schedules import k_for
from lightning_sparse.state import Member, SparseState
from lightning_sparse.wire import GATHER, MessageLayout, ring_all_reduce_bytes

#: the world sizes of the model rows (any measured one is added)
MODEL_WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DENSE = "dense"
#: column -> the SparseState arguments of that configuration (besides compressor and density)
CONFIGS: dict[str, dict[str, Any]] = {
    "allgather int32": {"exchange": "allgather", "compact_indices": False, "fallback_to_dense": False},
    "allgather compact": {"exchange": "allgather", "compact_indices": True, "fallback_to_dense": False},
    "split int32": {"exchange": "split", "compact_indices": False, "fallback_to_dense": False},
    "split compact": {"exchange": "split", "compact_indices": True, "fallback_to_dense": False},
    "auto": {},  # the defaults: exchange="auto", compact indices, the byte fallback
    "auto bf16": {"value_dtype": "bfloat16"},
}
COLUMNS = (DENSE, *CONFIGS)
HEADERS = {
    DENSE: "dense MB",
    "allgather int32": "allgather int32",
    "allgather compact": "allgather compact",
    "split int32": "split int32",
    "split compact": "split compact",
    "auto": "auto (compact, defaults)",
    "auto bf16": "auto, bf16 values",
}
#: relative tolerance of measured == model
TOLERANCE = 1e-9
#: gradients are float32: the dense parts and a dense bucket travel as 4-byte values
GRAD_DTYPE = torch.float32
TARGET_W = 64
TARGET_FRACTION = 1 / 15
TARGET_BYTES_PER_COORD = 3.5
TARGET_SPLIT_W = 8
TARGET_SPLIT_RATIO = 0.4


# --------------------------------------------------------------------------- arguments
def parse_count(option: str, text: str, minimum: float = 1e4) -> int:
    """``"25e6"`` -> 25000000; anything below ``minimum`` or not a number raises naming ``option``."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{option}={text!r} is not allowed: expected a number of parameters >= {minimum:g}, e.g. 2e6")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="25e6", help="parameters of the modelled MLP (default 25e6)")
    parser.add_argument("--layers", type=int, default=6, help="square Linear layers of the MLP")
    parser.add_argument("--density", type=float, default=0.01, help="fraction of each tensor top-k sends")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap in MiB, as DDP's bucket_cap_mb")
    parser.add_argument(
        "--measure-params", default="2e6", help="parameters of the MLP the processes exchange (default 2e6)"
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8], help="numbers of processes to measure")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each measured world size may take")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON")
    parser.add_argument(
        "--plot", default=None, metavar="PATH", help="also plot MB per rank per step against W (needs matplotlib)"
    )
    # one measuring process (started by the benchmark itself)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)


def check_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first argument that is not allowed."""
    parse_count("--params", args.params)
    parse_count("--measure-params", args.measure_params)
    if args.layers < 1:
        raise ValueError(f"--layers={args.layers} is not allowed: expected an integer >= 1")
    if not 0 < args.density <= 1:
        raise ValueError(f"--density={args.density:g} is not allowed: expected a fraction in (0, 1]")
    if not args.bucket_mb > 0:
        raise ValueError(f"--bucket-mb={args.bucket_mb:g} is not allowed: expected a number of MiB > 0")
    bad = [w for w in args.world_sizes if w < 2]
    if bad:
        raise ValueError(
            f"--world-sizes {' '.join(map(str, args.world_sizes))} is not allowed: expected process counts >= 2 "
            f"(got {bad[0]}; at 1 nothing crosses the wire)"
        )
    if not args.timeout > 0:
        raise ValueError(f"--timeout={args.timeout:g} is not allowed: expected a number of seconds > 0")


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Bucket:
    """One DDP-like bucket: ``(name, numel)`` of its tensors in buffer order."""

    tensors: tuple[tuple[str, int], ...]

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.tensors)


def mlp_tensors(params: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of the MLP's parameters in model order: weight and bias of each layer."""
    width = model_shape(params, layers)
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        out += [(f"layers.{i}.weight", (width, width)), (f"layers.{i}.bias", (width,))]
    return out


def ddp_buckets(tensors: list[tuple[str, tuple[int, ...]]], cap_bytes: int) -> list[Bucket]:
    """Tensors in reverse order (as DDP fills its buckets during backward), at most ``cap_bytes`` of
    float32 gradient per bucket; a tensor above the cap gets a bucket of its own."""
    buckets: list[Bucket] = []
    current: list[tuple[str, int]] = []
    size = 0
    for name, shape in reversed(tensors):
        numel = math.prod(shape)
        nbytes = numel * GRAD_DTYPE.itemsize
        if current and size + nbytes > cap_bytes:
            buckets.append(Bucket(tuple(current)))
            current, size = [], 0
        current.append((name, numel))
        size += nbytes
    if current:
        buckets.append(Bucket(tuple(current)))
    return buckets


def make_state(config: str, density: float) -> SparseState:
    """The hook's state of one configuration (top-k at ``density``)."""
    return SparseState(compressor="topk", density=density, **CONFIGS[config])


def bucket_wire(config: str, density: float, world: int, bucket: Bucket) -> tuple[float, str]:
    """``(wire bytes per rank, how the bucket is sent)`` of one bucket's sparse step: ``"dense"``,
    ``"allgather"`` or ``"split"``."""
    dense = ring_all_reduce_bytes(world, bucket.numel * GRAD_DTYPE.itemsize)
    if config == DENSE:
        return dense, "dense"
    state = make_state(config, density)
    state.world_size = world
    sparse, small, offset = [], 0, 0
    for name, numel in bucket.tensors:
        if numel >= state.min_numel and numel > 0:
            sparse.append(Member(name, 0, offset, numel, True))
        else:
            small += numel
        offset += numel
    if not sparse:
        return dense, "dense"
    rate = state.schedule.density(state.warmup_steps)
    ks = [k_for(m.numel, rate) for m in sparse]
    # the hook's own byte rule, on a float32 bucket (only its dtype is read)
    if state.fallback_to_dense and not sparse_is_cheaper(state, torch.empty(0, dtype=GRAD_DTYPE), tuple(sparse), ks):
        return dense, "dense"
    vbytes = (state.value_dtype or GRAD_DTYPE).itemsize
    numels = [m.numel for m in sparse]
    how, wire = GATHER.choose(world, ks, vbytes, numels, state.exchange, state.compact_indices)
    return wire + ring_all_reduce_bytes(world, small * GRAD_DTYPE.itemsize), how


def model_row(buckets: list[Bucket], density: float, world: int) -> dict[str, Any]:
    """Every column's wire bytes per rank per step at ``world`` ranks, and how each bucket goes."""
    row: dict[str, Any] = {"world": world, "bytes": {}, "sent_as": {}}
    for column in COLUMNS:
        figures = [bucket_wire(column, density, world, b) for b in buckets]
        row["bytes"][column] = sum(wire for wire, _ in figures)  # summed in bucket order, as the telemetry
        row["sent_as"][column] = [how for _, how in figures]
    return row


def describe_size(params: int, layers: int, cap_bytes: int, density: float) -> dict[str, Any]:
    tensors = mlp_tensors(params, layers)
    buckets = ddp_buckets(tensors, cap_bytes)
    min_numel = SparseState().min_numel
    return {
        "params": sum(b.numel for b in buckets),
        "width": model_shape(params, layers),
        "layers": layers,
        "buckets": [
            {
                "tensors": [name for name, _ in b.tensors],
                "numel": b.numel,
                "sparse_numel": sum(n for _, n in b.tensors if n >= min_numel),
                "k": sum(k_for(n, density) for _, n in b.tensors if n >= min_numel),
            }
            for b in buckets
        ],
    }


# --------------------------------------------------------------------------- one measuring rank
def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )
    tensors = mlp_tensors(parse_count("--measure-params", args.measure_params), args.layers)
    params = {name: torch.zeros(shape, requires_grad=True) for name, shape in tensors}
    buckets = ddp_buckets(tensors, int(args.bucket_mb * 1024 * 1024))
    figures: dict[str, list[dict[str, Any]]] = {}
    for config in CONFIGS:
        state = make_state(config, args.density)
        state.bind(params.items())
        steps = []
        for step in range(state.warmup_steps + 1):  # the dense warm-up step(s), then one sparse step
            gen = torch.Generator().manual_seed(1000 * args.rank + step)
            futures = []
            for i, bucket in enumerate(buckets):
                buffer = torch.randn(bucket.numel, generator=gen, dtype=GRAD_DTYPE)
                members = [params[name] for name, _ in bucket.tensors]
                futures.append(communicate(state, buffer, members, is_last=i == len(buckets) - 1))
            for future in futures:
                future.wait()
            last = state.telemetry.last  # the whole step: the hook ends a step at its last bucket
            steps.append(
                {
                    "wire_bytes": last.wire_bytes,
                    "dense_wire_bytes": last.dense_wire_bytes,
                    "sent_bytes": last.sent_bytes,
                    "buckets": last.buckets,
                    "dense_buckets": last.dense_buckets,
                }
            )
        figures[config] = steps
    gathered: list[Any] = [None] * args.world
    dist.all_gather_object(gathered, figures)
    if args.rank == 0 and args.result:
        Path(args.result).write_text(json.dumps({"ranks": gathered}))
    end_process_group(exit_code=0)  # on every rank together, then out: see its docstring
    return 0


# --------------------------------------------------------------------------- the parent
def launch(args: argparse.Namespace, world: int, tmp: Path) -> list[dict[str, Any]]:
    """Run ``world`` measuring processes; every rank's figures (killing them all past ``--timeout``)."""
    result = tmp / f"result_{world}.json"
    port = free_port()
    base = [
        sys.executable, "-m", "lightning_sparse.bench", "scale", "--worker", "--world", str(world),
        "--port", str(port), "--measure-params", str(args.measure_params), "--layers", str(args.layers),
        "--density", repr(args.density), "--bucket-mb", repr(args.bucket_mb), "--timeout", repr(args.timeout),
    ]  # fmt: skip
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmds = [[*base, "--rank", str(rank)] + (["--result", str(result)] if rank == 0 else []) for rank in range(world)]
    logs = [tmp / f"w{world}_rank{rank}.log" for rank in range(world)]
    codes, timed_out = run_ranks(cmds, env, logs, args.timeout)
    if timed_out or any(codes) or not result.is_file():
        tails = "".join(
            f"\n--- rank {rank} (exit code {code}) ---\n{path.read_text(errors='replace')[-2000:]}"
            for rank, (path, code) in enumerate(zip(logs, codes, strict=True))
        )
        why = f"did not finish within --timeout={args.timeout:g} s and were killed" if timed_out else "failed"
        raise RuntimeError(f"scale: the {world} measuring processes {why} (exit codes {codes}).{tails}")
    return json.loads(result.read_text())["ranks"]


def measured_row(ranks: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """The sparse step's wire bytes per configuration (the same on every rank: checked), and the
    dense warm-up step's."""
    row: dict[str, Any] = {"world": world, "bytes": {}}
    dense_figures: set[float] = set()
    for config in CONFIGS:
        per_rank = [r[config][-1]["wire_bytes"] for r in ranks]
        if any(v != per_rank[0] for v in per_rank):
            raise RuntimeError(f"scale: the ranks report different wire bytes for {config} at W={world}: {per_rank}")
        row["bytes"][config] = per_rank[0]
        dense_figures.update(s["wire_bytes"] for r in ranks for s in r[config][:-1])
        dense_figures.update(r[config][-1]["dense_wire_bytes"] for r in ranks)
    if len(dense_figures) != 1:
        raise RuntimeError(f"scale: the dense steps at W={world} report different wire bytes: {sorted(dense_figures)}")
    row["bytes"][DENSE] = dense_figures.pop()
    row["dense_buckets"] = {config: ranks[0][config][-1]["dense_buckets"] for config in CONFIGS}
    return row


def check_measured(measured: dict[str, Any], model: dict[str, Any]) -> float:
    """Raise when a measured figure is not the model's; the largest relative difference."""
    worst = 0.0
    for column in COLUMNS:
        got, want = measured["bytes"][column], model["bytes"][column]
        rel = abs(got - want) / max(abs(want), 1.0)
        if rel > TOLERANCE:
            raise RuntimeError(
                f"scale: at W={measured['world']} the telemetry counted {got:.1f} wire bytes per rank for {column}, "
                f"the ring model {want:.1f} (relative difference {rel:.2e} > {TOLERANCE:g})"
            )
        worst = max(worst, rel)
    for config in CONFIGS:
        got, want = measured["dense_buckets"][config], model["sent_as"][config].count("dense")
        if got != want:
            raise RuntimeError(
                f"scale: at W={measured['world']} the hook sent {got} bucket(s) dense for {config}, the model {want}"
            )
    return worst


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
    lines += ["", "targets:"]
    for t in result["targets"]:
        lines.append(f"- ({t['name']}) {'PASS' if t['passed'] else 'FAIL'}: {t['text']}: {t['value']}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """MB per rank per step against W (log-log): the model's lines at both sizes, the measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # auto coincides with allgather or split: drawn wide and pale underneath, so both stay visible
    series = {
        DENSE: ("dense", "black", "o", 1.8, 1.0),
        "allgather compact": ("allgather", "tab:red", "s", 1.8, 1.0),
        "split compact": ("split", "tab:blue", "^", 1.8, 1.0),
        "auto": ("auto (defaults)", "tab:green", "o", 7.0, 0.35),
    }
    fig, ax = plt.subplots(figsize=(7.5, 5))
    big, small = result["model"], result["measure_model"]
    for column, (label, color, marker, width, alpha) in series.items():
        for size, style, thin in ((big, "-", 1.0), (small, "--", 0.6)):
            ws = [r["world"] for r in size["rows"]]
            mb = [r["bytes"][column] / 1e6 for r in size["rows"]]
            ax.plot(
                ws, mb, style, color=color, lw=width * thin, alpha=alpha, zorder=1 if column == "auto" else 2,
                label=f"{label}, model {size['size']['params'] / 1e6:.1f}M",
            )  # fmt: skip
        if result["measured"]:
            ws = [r["world"] for r in result["measured"]]
            mb = [r["bytes"][column] / 1e6 for r in result["measured"]]
            big_marker = column == "auto"
            ax.plot(
                ws, mb, marker, color=color, ms=13 if big_marker else 6, mfc="none", mew=2.5 if big_marker else 1.4,
                alpha=0.6 if big_marker else 1.0, zorder=3,
            )  # fmt: skip
    ax.plot([], [], "o", color="gray", mfc="none", mew=1.4, label=f"measured {small['size']['params'] / 1e6:.1f}M")
    worlds = [r["world"] for r in big["rows"]]
    ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_yscale("log")
    ax.set_xlabel("ranks W")
    ax.set_ylabel("MB per rank per step (ring model)")
    ax.set_title(f"top-k {result['density']:g}: wire bytes per rank per step (compact indices)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args)
    check_arguments(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise RuntimeError('--plot needs matplotlib: pip install "lightning_sparse[plot]"') from err
    start = time.perf_counter()
    cap = int(args.bucket_mb * 1024 * 1024)
    world_sizes = list(dict.fromkeys(args.world_sizes))
    all_worlds = sorted(set(MODEL_WORLD_SIZES) | set(world_sizes))
    result: dict[str, Any] = {
        "density": args.density,
        "layers": args.layers,
        "bucket_mb": args.bucket_mb,
        "torch": torch.__version__,
        "configs": {c: CONFIGS.get(c, {}) for c in COLUMNS},
    }
    for key, params in (("model", args.params), ("measure_model", args.measure_params)):
        count = parse_count("--params" if key == "model" else "--measure-params", params)
        buckets = ddp_buckets(mlp_tensors(count, args.layers), cap)
        result[key] = {
            "size": describe_size(count, args.layers, cap, args.density),
            "rows": [model_row(buckets, args.density, w) for w in all_worlds],
        }
    model_at = {r["world"]: r for r in result["measure_model"]["rows"]}
    result["measured"] = []
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for world in world_sizes:
            began = time.perf_counter()
            print(f"scale: measuring on {world} processes ...", file=sys.stderr, flush=True)
            row = measured_row(launch(args, world, Path(tmp)), world)
            row["seconds"] = time.perf_counter() - began
            worst = max(worst, check_measured(row, model_at[world]))
            result["measured"].append(row)
    result["measured_vs_model_max_rel"] = worst
    result["targets"] = targets(result)
    result["seconds"] = time.perf_counter() - start
    print(format_table(result))
    took = ", ".join(f"{r['seconds']:.0f} s" for r in result["measured"])
    print(
        f"\nmeasured == model at W = {', '.join(map(str, world_sizes))} (largest relative difference {worst:.1e}); "
        f"measuring took {took}; "
        f"{result['seconds']:.0f} s in all"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)
    return 0 if all(t["passed"] for t in result["targets"]) else 1
