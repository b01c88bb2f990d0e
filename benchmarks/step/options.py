"""The step benchmark's command line: its options, their parsers and the names the other parts share."""

from __future__ import annotations

import argparse
import math
import re
from typing import Literal

from benchmarks.peers import PEER_HELP

DEFAULT_COMPRESSORS = ["topk", "randomk", "rtopk", "gaussiank", "dgc", "randomblock", "countsketch"]
DENSE = "dense DDP"
#: ``--fallback`` -> the sparse runs' ``fallback_to_dense``
FALLBACKS: dict[str, bool | Literal["time"]] = {"bytes": True, "time": "time", "off": False}
#: ``SparseDDPStrategy(exchange=...)``
Exchange = Literal["auto", "allgather", "split"]
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float | None:
    """``"1gbit"`` / ``"100mbit"`` / ``"500kbit"`` -> bits per second; ``"none"`` -> None (unshaped)."""
    t = text.strip().lower()
    if t in ("none", "unshaped", "0"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)", t)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--bandwidth={text!r} is not allowed: expected e.g. 100mbit, 1gbit, 10gbit or none")
    bits = float(m.group(1)) * _UNITS[m.group(2)]
    return bits * 8 if m.group(3) == "bps" else bits  # tc's "bps" means bytes per second


def parse_latency(text: str) -> float:
    """``"1ms"`` / ``"500us"`` / ``"0"`` -> seconds."""
    t = text.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|ms|us)?", t)
    if not m:
        raise ValueError(f"--latency={text!r} is not allowed: expected e.g. 0, 500us, 1ms or 20ms")
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, None: 1e-3}[m.group(2)]
    return float(m.group(1)) * scale


def parse_params(text: str) -> int:
    """``"25e6"`` / ``"25000000"`` -> 25000000 (>= 1e4)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 1e4:
        raise ValueError(f"--params={text!r} is not allowed: expected a number of parameters >= 1e4, e.g. 25e6")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bandwidth", default="1gbit", help="link rate: 100mbit, 1gbit, 10gbit, ... or none")
    parser.add_argument("--latency", default="0", help="added one-way delay per packet: 0, 500us, 1ms, ...")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (processes) on this machine")
    parser.add_argument("--params", default="25e6", help="model size in parameters (default 25e6)")
    parser.add_argument("--layers", type=int, default=6, help="square Linear layers of the MLP")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument(
        "--compressors",
        nargs="+",
        default=DEFAULT_COMPRESSORS,
        help="names, optionally with arguments: rtopk:r_factor=2",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["update", "gradient"],
        default=["update", "gradient"],
        help="what the sparse runs compress, SparseDDPStrategy(compress=MODE) (default: %(default)s)",
    )
    parser.add_argument(
        "--exchanges",
        nargs="+",
        choices=["auto", "allgather", "split"],
        default=["auto"],
        help="how top-k-type selections are combined, SparseDDPStrategy(exchange=...); other compressors "
        "run once (default: %(default)s)",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        nargs="+",
        default=[1],
        metavar="H",
        help="update mode: exchange every H optimizer steps, SparseDDPStrategy(sync_every=H); one row each "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--sync-delay",
        type=int,
        nargs="+",
        default=[0],
        metavar="D",
        help="update mode with H > 1: apply each exchange D optimizer steps after its launch, "
        "SparseDDPStrategy(sync_delay=D); one row each; a run with a delay takes its steps in a block of its "
        "own, without a barrier between steps (default: %(default)s)",
    )
    parser.add_argument(
        "--fragments",
        type=int,
        nargs="+",
        default=[1],
        metavar="F",
        help="update mode with H > 1: exchange the parameters in F staggered fragments, "
        "SparseDDPStrategy(fragments=F); one row each (default: %(default)s)",
    )
    parser.add_argument(
        "--value-bits",
        type=int,
        choices=[2, 4, 8],
        default=None,
        help="the sparse runs' value_bits (default: none, float values)",
    )
    parser.add_argument(
        "--warmup-exchanges",
        type=int,
        default=None,
        metavar="N",
        help="the sparse runs' warmup_steps (default: the strategy's)",
    )
    parser.add_argument(
        "--fallback",
        choices=list(FALLBACKS),
        default="bytes",
        help="the sparse runs' fallback_to_dense: bytes (the default, True), time, or off (False)",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=[],
        metavar="PEER",
        help=f"torch's DDP comm hooks as extra rows: {PEER_HELP}; bare powersgd: rank 4 (default: none)",
    )
    parser.add_argument(
        "--probe-timeout",
        type=float,
        default=300.0,
        help="seconds a peer's probe (its ranks alone, a few steps) may take before it counts as failed",
    )
    parser.add_argument(
        "--unshaped-baseline",
        action="store_true",
        help="with a shaped link: run the same timed runs on the unshaped loopback first and report each "
        "run's mean step on the link against its own unshaped one and the unshaped dense one (the compute "
        "floor); dense DDP then runs unshaped only",
    )
    parser.add_argument("--no-dense", action="store_true", help="leave out the dense DDP run (ratios then absent)")
    parser.add_argument(
        "--rev",
        default=None,
        metavar="REV",
        help="compare with the package as it is at this git revision (bfb574b or later): the same runs under the "
        "old package and under the working tree's, alternating, their step times side by side (no --peers, "
        "no --unshaped-baseline)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="with --rev: launches of each code, alternating (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run first (bucket rebuild, caches)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the worker runs the peers only
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--package-root", default=None, help=argparse.SUPPRESS)  # where lightning_sparse must come from
