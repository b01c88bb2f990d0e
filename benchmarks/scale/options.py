"""The scale benchmark's command line: its options and their checks."""

from __future__ import annotations

import argparse
import math


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
