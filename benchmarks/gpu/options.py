"""The GPU step benchmark's command line, its runs and its models."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Run:
    """One row: ``floor`` (independent single-process loops at once), ``dense`` (Lightning's DDP
    strategy) or ``sparse`` (``lightning_sparse.fabric.SparseDDPStrategy(**settings)``)."""

    kind: Literal["floor", "dense", "sparse"]
    label: str
    settings: dict[str, Any] = field(default_factory=dict)


#: name -> run, in the order they run
RUNS: dict[str, Run] = {
    "floor": Run("floor", "floor (independent processes)"),
    "dense": Run("dense", "dense DDP"),
    "default": Run("sparse", "sparse_ddp default"),
    "every4": Run(
        "sparse", "sync_every=4, value_bits=2, warmup_steps=0", {"sync_every": 4, "value_bits": 2, "warmup_steps": 0}
    ),
    "every4-fragments": Run(
        "sparse",
        "sync_every=4, value_bits=2, warmup_steps=0, fragments=4, sync_delay=1",
        {"sync_every": 4, "value_bits": 2, "warmup_steps": 0, "fragments": 4, "sync_delay": 1},
    ),
}

#: rows that run only when named in ``--runs``: the floor's processes meeting (a barrier on the
#: host, after the step's end on the device) every 4th step, as ``sync_every=4`` makes them meet,
#: with nothing exchanged
EXTRA_RUNS: dict[str, Run] = {
    "floor-meet4": Run("floor", "floor, the processes meeting every 4th step", {"meet_every": 4}),
}

#: model -> the TinyGPT's shape and the batch per process: ``gpt2`` is GPT-2 small's transformer
#: (12 blocks of width 768, 12 heads; a byte vocabulary and 256 positions: 85.4M parameters in 148
#: tensors), ``tiny`` a two-block one for a quick run on CPUs
MODELS: dict[str, dict[str, int]] = {
    "gpt2": {"vocab": 256, "context": 256, "width": 768, "layers": 12, "heads": 12, "batch": 8},
    "tiny": {"vocab": 97, "context": 16, "width": 32, "layers": 2, "heads": 2, "batch": 4},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--accelerator", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", choices=list(MODELS), default="gpt2", help="(default: %(default)s)")
    parser.add_argument(
        "--runs", nargs="+", default=list(RUNS), metavar="NAME",
        help=f"which rows, in this order: {', '.join([*RUNS, *EXTRA_RUNS])} or a --variants name "
        f"(default: {', '.join(RUNS)})",
    )  # fmt: skip
    parser.add_argument(
        "--variants", nargs="*", default=[], metavar="NAME=JSON",
        help="more sparse rows, the strategy's arguments as JSON: 'local={\"sync_every\": 1000}' (name them in --runs)",
    )  # fmt: skip
    parser.add_argument("--world-size", type=int, default=2, help="processes (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=None, help="per process (default: the model's)")
    parser.add_argument("--precision", default=None, help="Fabric's precision (default: bf16-mixed on CUDA, else 32)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (default: %(default)s)")
    parser.add_argument(
        "--profile-steps", type=int, default=4, help="steps profiled on rank 0 after the timed ones (0: none)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process on CPUs")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--trace", default=None, metavar="DIR", help="write each row's profile as a gzipped Chrome trace (rank 0)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)


def add_variants(specs: list[str], runs: list[str]) -> None:
    """Register ``--variants`` rows (``NAME=JSON``: a sparse row of those settings) in :data:`RUNS`
    and check that every name of ``--runs`` is a row (:data:`EXTRA_RUNS` join it when named)."""
    import json

    for name in runs:
        if name in EXTRA_RUNS:
            RUNS[name] = EXTRA_RUNS[name]
    for spec in specs:
        name, _, settings = spec.partition("=")
        try:
            parsed = json.loads(settings) if name else None
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict) or name in RUNS:
            raise ValueError(f"--variants {spec!r} is not allowed: expected NAME=JSON, a new name and a JSON object")
        RUNS[name] = Run("sparse", ", ".join(f"{k}={v}" for k, v in parsed.items()) or name, parsed)
    unknown = [name for name in runs if name not in RUNS]
    if unknown:
        raise ValueError(f"--runs {unknown} is not allowed: the rows are {', '.join(RUNS)}")
