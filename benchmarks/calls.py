"""Python calls of one steady-state default exchange, and the package files they pass through, under
the code at a git revision and under the working tree.

Two CPU processes (gloo) train the GPT-2-shaped demo GPT of ``tests/test_exchange_ops.py``
(``TinyGPT``, 12 blocks of width 64: 148 tensors, 0.61M parameters) with AdamW under Lightning
Fabric and ``FabricSparseDDPStrategy(min_numel=128)`` (with ``min_numel=128`` its tensors split into
sparse and dense as GPT-2 small's do at the default 1024; every other setting the default: update
mode, top-k at density 0.01, an exchange every step). After ``--warmup`` steps (the first one is the
dense warm-up) each of ``--measured`` optimizer steps is profiled with ``sys.setprofile``, on the
process's main thread (the only one it sees; gloo's threads run no Python). What is counted:

- the span: from the call of the strategy's ``optimizer_step`` (as ``type(strategy)`` resolves it)
  to its return, that is, Fabric's ``optimizer.step()`` without its two-line wrapper: Lightning's
  precision plugin, the package's update mode around the torch optimizer's step (this rank's view
  put in the module, the step, the exchange, the global parameters back) and torch's own
  ``Optimizer.step`` wrappers (its hooks: a step hook the package registers is counted here);
- ``exchange``: the profile's ``'call'`` events (Python functions called) and ``'c_call'`` events
  (C functions called from Python: torch operators, builtins, ``Work.wait``) in that span, apart
  from those under the torch optimizer's own step (``AdamW.step``'s body, unwrapped), which are
  reported as ``optimizer``; returns and exceptions are not counted;
- ``package``: of the exchange's, the ``'call'`` events of functions defined in the
  ``lightning_sparse`` package and the ``'c_call'`` events made from the package's frames;
- files: the package's files whose functions are called (with how many calls each, and how many
  times the path enters it from another file or from outside the package); moves: calls from a
  function of one package file to a function of another (the caller being the nearest frame of
  package code), returns not counted.

A callback chained to a collective's future runs on this thread if the collective had completed
when it was chained, else on gloo's thread, unseen: a step can count a few calls more (2 for each
such callback, ``comm.py``'s ``done`` and the future's ``set_result``). The figures are those of the
measured step, over both ranks, with the fewest exchange calls; every rank's totals by step are
printed too.

    python -m benchmarks calls                 # bfb574b and the working tree, side by side
    python -m benchmarks calls --rev HEAD --json calls.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._json import write_json
from benchmarks._ranks import CHECKOUT
from benchmarks._revs import extract, run_worker

WORKER = Path(__file__).resolve().parent / "calls_worker.py"
#: the strategy's arguments: the default exchange, the tensors split as GPT-2 small's
ARGS: dict[str, Any] = {"min_numel": 128}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rev", default="bfb574b", help="git revision of the old code (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=4, help="steps before the measured ones (default: %(default)s)")
    parser.add_argument("--measured", type=int, default=3, help="steps profiled (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")


def measure(root: Path, work: Path, warmup: int = 4, measured: int = 3, timeout: float = 300.0) -> dict[str, Any]:
    """Profile ``measured`` steps after ``warmup`` with the package under ``root`` (on 2 processes, in
    ``work``, a new folder); return every rank's counts by step and the figures of the step with
    the fewest exchange calls."""
    config = {"processes": 2, "args": ARGS, "warmup": warmup, "measured": measured, "runs": [{"name": "calls"}]}
    ranks = run_worker(WORKER, root, config, work, timeout)["calls"]
    fewest = min((s for r in ranks for s in r["steps"]), key=lambda s: s["exchange"].get("call", 0))
    return {
        **fewest,
        "tensors": ranks[0]["tensors"],
        "per_step": {r["rank"]: [s["exchange"] for s in r["steps"]] for r in ranks},
        "complete": all(s["complete"] for r in ranks for s in r["steps"]),
    }


def _rows(figures: dict[str, dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    sides = list(figures.values())
    return [
        ("Python calls ('call')", [f["exchange"].get("call", 0) for f in sides]),
        ("C calls ('c_call')", [f["exchange"].get("c_call", 0) for f in sides]),
        ("calls of the package's functions", [f["package"].get("call", 0) for f in sides]),
        ("C calls from the package's frames", [f["package"].get("c_call", 0) for f in sides]),
        ("package files passed through", [len(f["files"]) for f in sides]),
        ("moves between package files", [f["moves"] for f in sides]),
        (
            "AdamW's own step: call / c_call",
            [f"{f['optimizer'].get('call', 0)} / {f['optimizer'].get('c_call', 0)}" for f in sides],
        ),
    ]


def run(args: argparse.Namespace) -> int:
    for flag, value, least in (("--warmup", args.warmup, 2), ("--measured", args.measured, 1)):
        if value < least:
            raise ValueError(f"{flag}={value} is not allowed: expected an integer >= {least}")
    start = time.perf_counter()
    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="calls_") as tmp:
        commit = extract(args.rev, Path(tmp, "old"))
        for side, root in ((f"old ({commit[:7]})", Path(tmp, "old")), ("tree", CHECKOUT)):
            work = Path(tmp, "runs", side.split()[0])
            figures[side] = measure(root, work, args.warmup, args.measured, args.timeout)
            print(f"{side}: measured in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    tensors = {f["tensors"] for f in figures.values()}
    print(
        f"one default exchange (update mode, top-k 0.01, min_numel=128), {'/'.join(map(str, tensors))} tensors, "
        f"2 processes: the fewest of {args.measured} steps after {args.warmup} on each"
    )
    print("| per exchange | " + " | ".join(figures) + " |")
    print("| --- |" + " ---: |" * len(figures))
    for label, values in _rows(figures):
        print(f"| {label} | " + " | ".join(str(v) for v in values) + " |")
    for side, f in figures.items():
        steps = {rank: [s.get("call", 0) for s in counts] for rank, counts in f["per_step"].items()}
        print(f"\n{side}: calls per measured step by rank {steps}; files (calls, entries):")
        print("  " + ", ".join(f"{name} {n} ({f['entries'].get(name, 0)})" for name, n in f["files"].items()))
    incomplete = [side for side, f in figures.items() if not f["complete"]]
    if incomplete:
        print(f"a profiled step did not return within its span: {incomplete}")
    if args.json:
        write_json(args.json, {"rev": commit, "args": vars(args), "figures": figures})
    return 1 if incomplete else 0
