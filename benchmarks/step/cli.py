"""The command: checks the arguments, probes the peers, runs the timed ranks (on the shaped link where
it can be made) and prints and writes the figures."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._json import write_json
from benchmarks._ranks import CHECKOUT, free_port
from benchmarks._revs import extract
from benchmarks.peers import Peer
from benchmarks.step.launcher import _launch
from benchmarks.step.link import ShapedLink, describe_link
from benchmarks.step.options import DENSE, parse_latency, parse_params, parse_rate
from benchmarks.step.report import failed_row, format_old_new, format_table, old_new_rows
from benchmarks.step.worker import worker


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args)
    rate = parse_rate(args.bandwidth)
    delay = parse_latency(args.latency)
    parse_params(args.params)
    for name in ("world_size", "steps", "layers", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is not allowed: expected >= 1")
    if args.warmup < 2:
        raise ValueError(
            f"--warmup={args.warmup} is not allowed: expected >= 2 (DDP rebuilds its buckets after step 1)"
        )
    if not 0 < args.density <= 1:
        raise ValueError(f"--density={args.density} is not allowed: expected a number in (0, 1]")
    if args.rev is not None:
        if args.peers or args.unshaped_baseline:
            raise ValueError("--rev is not allowed with --peers or --unshaped-baseline: it compares the package's runs")
        if args.rounds < 1:
            raise ValueError(f"--rounds={args.rounds} is not allowed: expected >= 1")
    if args.fallback == "time":
        # the timed steps come after the trial (warm-up step, trial, the step that decides)
        from lightning_sparse import TimedFallback

        args.warmup = max(args.warmup, TimedFallback().trial_length + 2)
    link: ShapedLink | None = None
    if rate is not None or delay > 0:
        why = ShapedLink.unavailable()
        if why:
            print(f"step: {why}; running on the unshaped loopback instead.", file=sys.stderr)
            rate, delay = None, 0.0
        else:
            link = ShapedLink(rate or 1e12, delay)
    peers = list(dict.fromkeys(Peer.parse(spec).name for spec in args.peers))  # raises on a bad name
    if args.probe_timeout <= 0:
        raise ValueError(f"--probe-timeout={args.probe_timeout} is not allowed: expected a number of seconds > 0")
    wrap: Callable[[list[str]], list[str]] = (lambda cmd: cmd) if link is None else link.wrap
    if args.rev is not None:
        return _old_against_new(args, link, wrap, describe_link(rate, delay))
    baseline: dict[str, Any] | None = None
    if getattr(args, "unshaped_baseline", False) and link is not None:
        # the same runs on the unshaped loopback, in the same invocation: each run's compute floor
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "result.json"
            print("step: the unshaped baseline ...", file=sys.stderr)
            why = _launch(args, Path(tmp) / "unshaped", lambda cmd: cmd, free_port(), ["--peers"], result_path=path)
            if why is not None:
                raise RuntimeError(f"the unshaped baseline failed: {why}")
            baseline = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as tmp, link if link is not None else contextlib.nullcontext():

        def launch(tag: str, extra: list[str], **kwargs: Any) -> str | None:
            return _launch(args, Path(tmp) / tag, wrap, free_port(), extra, **kwargs)

        failed: dict[str, str] = {}
        for name in peers:
            print(f"step: probing peer {name} ...", file=sys.stderr)
            probe = ["--probe", "--no-dense", "--peers", name, "--warmup", str(args.warmup), "--steps", "2"]
            why = launch(f"probe-{name}", probe, timeout=args.probe_timeout)
            if why is not None:
                print(f"step: peer {name} failed its probe ({why}); it is left out of the timed run.", file=sys.stderr)
                failed[name] = why
        ok = [name for name in peers if name not in failed]
        result_path = Path(tmp) / "result.json"
        # with an unshaped baseline, dense DDP runs there only (the compute floor; on a slow link its
        # every step would carry the whole model)
        shaped_only = ["--no-dense"] if baseline is not None else []
        why = launch("run", ["--peers", *ok, *shaped_only], result_path=result_path, echo=True)
        if why is not None:
            # Once more, without the peers if there were any (a peer can crash the run even after a
            # clean probe). A failure that repeats is raised below; one that does not is printed here.
            print(
                f"step: the timed run failed ({why}); running it again{' without the peers' if ok else ''}.",
                file=sys.stderr,
            )
            failed.update({name: f"crashed the timed run: {why}" for name in ok})
            why = launch("rerun", ["--peers"], result_path=result_path, echo=True)
        if why is not None:
            raise RuntimeError(f"the benchmark ranks failed: {why}")
        result = json.loads(result_path.read_text())
    result["runs"] += [failed_row(Peer.parse(name).label, failed[name]) for name in peers if name in failed]
    result["peers"] = peers
    result["link"] = describe_link(rate, delay)
    result["bandwidth_bits"] = rate
    result["latency_s"] = delay
    if baseline is not None:
        unshaped = {r["name"]: r.get("mean_s") for r in baseline["runs"]}
        for r in result["runs"]:
            r["unshaped_mean_s"] = unshaped.get(r["name"])
        result["unshaped_dense_mean_s"] = unshaped.get(DENSE)
    print(format_table(result))
    if args.json:
        write_json(args.json, result)
    return 0


def _old_against_new(
    args: argparse.Namespace, link: ShapedLink | None, wrap: Callable[[list[str]], list[str]], described: str
) -> int:
    """``--rev``: the same runs under the package at ``args.rev`` (extracted from git) and under the
    working tree's, launched in turn (old, new, old, new, ...: a busy machine slows both alike), the
    driver and the worker the working tree's; prints the table and writes the figures."""
    results: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp, link if link is not None else contextlib.nullcontext():
        commit = extract(args.rev, Path(tmp, "old"))
        for launch in range(args.rounds):
            for side, package in (("old", Path(tmp, "old")), ("new", CHECKOUT)):
                print(f"step: launch {launch + 1} of {args.rounds} under the {side} code ...", file=sys.stderr)
                logs = Path(tmp) / f"{side}{launch}"
                path = logs / "result.json"
                why = _launch(args, logs, wrap, free_port(), ["--peers"], result_path=path, package=package)
                if why is not None:
                    raise RuntimeError(f"the benchmark ranks failed under the {side} code: {why}")
                results[side].append({**json.loads(path.read_text()), "link": described})
    print(format_old_new(commit, results["old"], results["new"]))
    if args.json:
        rows = old_new_rows(results["old"], results["new"])
        write_json(args.json, {"rev": commit, "link": described, "rows": rows, **results})
    return 0
