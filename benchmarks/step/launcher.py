"""Starting the ranks of one timed (or probing) run, and a short reason when they fail."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks._ranks import run_ranks


def _launch(
    args: argparse.Namespace,
    logs: Path,
    wrap: Callable[[list[str]], list[str]],
    port: int,
    extra: list[str],
    *,
    timeout: float | None = None,
    result_path: Path | None = None,
    echo: bool = False,
    package: Path | None = None,
) -> str | None:
    """Run the ranks (``extra``: worker arguments after the forwarded ones, which they override); with
    ``package``, under the ``lightning_sparse`` in that folder (the worker checks it imported that one).

    Each rank's output goes to a file under ``logs``, replayed to stderr with ``echo`` (its tail
    when the ranks fail). Returns None when every rank exited cleanly, else a short reason (see
    :func:`failure_reason`; on a timeout, with the exception of a rank that died before it). Ranks
    still running at the timeout are killed.
    """
    base = [sys.executable, "-m", "benchmarks", "step", "--worker", "--port", str(port)]
    forwarded = [
        "--world-size", str(args.world_size), "--params", str(args.params), "--layers", str(args.layers),
        "--batch-size", str(args.batch_size), "--density", str(args.density), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--fallback", args.fallback, "--compressors", *args.compressors,
        "--modes", *args.modes, "--exchanges", *args.exchanges, "--sync-every", *map(str, args.sync_every),
        "--sync-delay", *map(str, args.sync_delay), "--fragments", *map(str, args.fragments),
    ]  # fmt: skip
    if args.value_bits is not None:
        forwarded += ["--value-bits", str(args.value_bits)]
    if args.warmup_exchanges is not None:
        forwarded += ["--warmup-exchanges", str(args.warmup_exchanges)]
    if args.threads is not None:
        forwarded += ["--threads", str(args.threads)]
    if args.no_dense:
        forwarded.append("--no-dense")
    if package is not None:
        forwarded += ["--package-root", str(package)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logs.mkdir(parents=True, exist_ok=True)
    cmds, paths = [], []
    for rank in range(args.world_size):
        cmd = [*base, "--rank", str(rank), *forwarded, *extra]
        if rank == 0 and result_path is not None:
            cmd += ["--result", str(result_path)]
        cmds.append(wrap(cmd))
        paths.append(logs / f"rank{rank}.log")
    limit = args.timeout if timeout is None else min(timeout, args.timeout)
    codes, timed_out = run_ranks(cmds, env, paths, limit, package)
    outputs = [path.read_text(errors="replace") for path in paths]
    ok = not timed_out and all(code == 0 for code in codes)
    for rank, text in enumerate(outputs):
        if text.strip() and (echo or not ok):
            sys.stderr.write(f"--- rank {rank} ({logs.name}) ---\n{text[-20000 if echo else -3000 :]}")
    if ok:
        return None
    # a rank killed here (a hang) has a negative code; one that died on its own says why
    crashed = [text for text, code in zip(outputs, codes, strict=True) if code not in (0, -signal.SIGKILL)]
    if timed_out:
        why = f"timed out after {limit:g} s"
        return f"{failure_reason(crashed, codes)}; the others then {why}" if crashed else why
    return failure_reason([text for text, code in zip(outputs, codes, strict=True) if code != 0], codes)


#: what a rank reports when another rank died under it: not the cause
_KNOCK_ON = re.compile(r"connection (closed|reset)|broken pipe|peer|timed out|socket", re.IGNORECASE)
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]: ?)?(?:[\w.]+\.)?(\w+(?:Error|Exception)): ?(.*)$")


def failure_reason(outputs: list[str], codes: list[int], limit: int = 120) -> str:
    """A short reason from the output of the failed ranks: the last exception line of each rank (a
    rank's own failure before a knock-on one of a rank that lost its peer), else the last line."""
    reasons = []
    for text in outputs:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        found = next((m for m in map(_EXCEPTION.match, reversed(lines)) if m), None)
        if found is not None:
            message = found.group(2).splitlines()[0] if found.group(2) else ""
            reasons.append(f"{found.group(1)}: {message}" if message else found.group(1))
        elif lines:
            reasons.append(lines[-1])
    if not reasons:
        return f"exit codes {codes}"
    reason = next((r for r in reasons if not _KNOCK_ON.search(r)), reasons[0])
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."
