"""Same result bit for bit: the parameters a fixed fit ends with, under the code at a git revision
and under the working tree.

Each setting is a fit of the demo GPT (``lightning_sparse.demos.TinyGPT``: 2 blocks of width 64, its
matrices sent sparse; ``GPTDataModule``, 16 windows of 32 characters per process and step) for
``--steps`` optimizer steps on CPU processes over gloo, with the Trainer and the strategy objects'
public arguments only, so that the same driver (``benchmarks/identical_worker.py``) runs on both
codes. The code at ``--rev`` is extracted from git (``git archive``) into a temporary folder; each
code runs in processes of their own with only its folder on ``PYTHONPATH`` (the worker checks where
``lightning_sparse`` came from). Runs are made deterministic: seeds, one thread per process,
``torch.use_deterministic_algorithms(True)``.

The checksum of a run is a SHA-256 over every rank's digest in rank order, each the SHA-256 of that
rank's final parameters (name, shape, dtype and bytes of each tensor, in the module's order; under
``sparse_fsdp`` its local shards). Besides old against new, every run's replicas are checked: every
rank holds the same parameters under ``sparse_ddp`` (the module holds the global model at the end
of fit), and under ``sparse_fsdp`` the ranks holding the same shard index do, the shards of one
group differing. The resumed fit must also end where the fit that wrote its checkpoint ends (saving applies the
exchange in flight early, so that fit differs from the ``fragments`` row: docs/guarantees.md).

Settings (``--only`` takes their names):

- ``default``: ``SparseDDPStrategy()``, 2 processes;
- ``local``: ``sync_every=4, value_bits=2, warmup_steps=0``, 2 processes;
- ``fragments``: those and ``fragments=4, sync_delay=1``, 2 processes;
- ``split``: ``exchange="split"``, 4 processes;
- ``gradient``: ``compress="gradient"``, 2 processes;
- ``fsdp``: ``SparseFSDPStrategy(shard_size=2, sharded_modules=["_Block"])``, 4 processes (2 groups of 2);
- ``resume``: the ``fragments`` settings, a fit that writes a checkpoint at the end of the epoch
  at half the steps (one exchange in flight: every step launches one, due a step later), then a
  fit resumed from it; both to ``--steps``.

The exit status is 1 if a checksum differs or a check of the replicas or of the resume fails.

    python -m benchmarks identical                     # bfb574b against the working tree
    python -m benchmarks identical --rev HEAD --only default fragments --json identical.json
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._json import write_json
from benchmarks._ranks import CHECKOUT
from benchmarks._revs import extract, run_worker

WORKER = Path(__file__).resolve().parent / "identical_worker.py"
#: optimizer steps of every fit
STEPS = 48
#: the settings of update mode's local steps
LOCAL: dict[str, Any] = {"sync_every": 4, "value_bits": 2, "warmup_steps": 0}
FRAGMENTS: dict[str, Any] = {**LOCAL, "fragments": 4, "sync_delay": 1}


@dataclass(frozen=True)
class Setting:
    """One row: a strategy and its arguments on a number of processes.

    Example:
        >>> Setting("default", "SparseDDPStrategy()", 2).strategy
        'sparse_ddp'
    """

    name: str
    label: str
    processes: int
    strategy: str = "sparse_ddp"
    args: dict[str, Any] = field(default_factory=dict)
    resume: bool = False


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("default", "SparseDDPStrategy()", 2),
        Setting("local", "sync_every=4, value_bits=2, warmup_steps=0", 2, args=LOCAL),
        Setting("fragments", "... + fragments=4, sync_delay=1", 2, args=FRAGMENTS),
        Setting("split", 'exchange="split", 4 processes', 4, args={"exchange": "split"}),
        Setting("gradient", 'compress="gradient"', 2, args={"compress": "gradient"}),
        Setting(
            "fsdp",
            "sparse_fsdp 2x2",
            4,
            strategy="sparse_fsdp",
            args={"shard_size": 2, "sharded_modules": ["_Block"]},
        ),
        Setting("resume", "fragments, resumed mid-flight", 2, args=FRAGMENTS, resume=True),
    )
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rev", default="bfb574b", help="git revision of the old code (default: %(default)s)")
    parser.add_argument(
        "--only", nargs="+", default=None, metavar="NAME", choices=list(SETTINGS), help="these settings only"
    )
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per fit (default: %(default)s)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds allowed per launch (default: %(default)s)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")


def epoch_steps(processes: int) -> int:
    """Optimizer steps in one epoch of the worker's data on ``processes`` processes.

    Example:
        >>> epoch_steps(2), epoch_steps(4)
        (12, 6)
    """
    from benchmarks.identical_worker import BATCH, WINDOWS

    return WINDOWS // (BATCH * processes)


def save_epoch(processes: int, steps: int) -> int:
    """The epoch at whose end the resumed setting's first fit writes its checkpoint: the last one
    ending at or before half the steps (at least the first).

    Example:
        >>> save_epoch(2, 48)  # 12 steps an epoch: the checkpoint after step 24
        1
    """
    return max(0, steps // 2 // epoch_steps(processes) - 1)


def _runs(settings: list[Setting], steps: int, work: Path) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for s in settings:
        run = {"name": s.name, "strategy": s.strategy, "args": s.args}
        if s.resume:
            checkpoint = str(work / f"{s.name}.ckpt")
            first = {**run, "name": f"{s.name}_first", "save_at_epoch": save_epoch(s.processes, steps)}
            runs += [{**first, "checkpoint": checkpoint}, {**run, "checkpoint": checkpoint}]
        else:
            runs.append(run)
    return runs


def launch(
    root: Path, settings: list[Setting], steps: int, work: Path, timeout: float
) -> dict[str, list[dict[str, Any]]]:
    """Run the fits of ``settings`` (all on the same number of processes) with the package under
    ``root``; return every rank's results by run name."""
    processes = {s.processes for s in settings}
    assert len(processes) == 1, processes
    config = {"processes": processes.pop(), "steps": steps, "runs": _runs(settings, steps, work)}
    return run_worker(WORKER, root, config, work, timeout)


def checksum(ranks: list[dict[str, Any]]) -> str:
    """SHA-256 over the ranks' digests, in rank order.

    Example:
        >>> checksum([{"rank": 1, "digest": "b"}, {"rank": 0, "digest": "a"}]) == checksum(
        ...     [{"rank": 0, "digest": "a"}, {"rank": 1, "digest": "b"}])
        True
    """
    digest = hashlib.sha256()
    for r in sorted(ranks, key=lambda r: r["rank"]):
        digest.update(f"{r['rank']}:{r['digest']};".encode())
    return digest.hexdigest()


def replica_problems(setting: Setting, ranks: list[dict[str, Any]], steps: int) -> list[str]:
    """What is wrong with a run's ranks: missing ones, a short fit, replicas that differ (or shards
    of one group that do not).

    Example:
        >>> ranks = [{"rank": 0, "digest": "a", "global_step": 4}, {"rank": 1, "digest": "b", "global_step": 4}]
        >>> replica_problems(SETTINGS["default"], ranks, 4)
        ['ranks 0, 1 should hold the same parameters: 2 different']
    """
    if sorted(r["rank"] for r in ranks) != list(range(setting.processes)):
        return [f"expected results of ranks 0..{setting.processes - 1}, got {sorted(r['rank'] for r in ranks)}"]
    problems = [f"rank {r['rank']} did {r['global_step']} steps" for r in ranks if r["global_step"] != steps]
    groups: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for r in ranks:  # sparse_fsdp: (replica group, shard index); the ranks of one shard index are replicas
        groups.setdefault(tuple(r["coords"][1:]) if r.get("coords") else (), []).append(r)
    for _, members in sorted(groups.items()):
        different = len({r["digest"] for r in members})
        if different > 1:
            names = ", ".join(str(r["rank"]) for r in members)
            problems.append(f"ranks {names} should hold the same parameters: {different} different")
    if len(groups) > 1 and len({members[0]["digest"] for members in groups.values()}) < len(groups):
        problems.append("shards of one group are equal")
    return problems


def compare(
    old: Path, settings: list[Setting], steps: int, work: Path, timeout: float, progress: bool = True
) -> list[dict[str, Any]]:
    """Run ``settings`` with the package under ``old`` and with the working tree's, in ``work`` (an
    empty folder); one row per setting (checksums, whether they are equal, the problems found)."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = {"old": {}, "new": {}}
    for side, root in (("old", old), ("new", CHECKOUT)):
        for processes in sorted({s.processes for s in settings}):
            group = [s for s in settings if s.processes == processes]
            start = time.perf_counter()
            found = launch(root, group, steps, work / f"{side}{processes}", timeout)
            results[side].update(found)
            if progress:
                cpu = sum(max(r["cpu_seconds"] for r in ranks) for ranks in zip(*found.values(), strict=True))
                print(
                    f"{side}, {processes} processes: {', '.join(s.name for s in group)} "
                    f"in {time.perf_counter() - start:.0f} s ({cpu:.0f} s of CPU)",
                    file=sys.stderr,
                    flush=True,
                )
    rows = []
    for s in settings:
        row: dict[str, Any] = {"setting": s.name, "label": s.label, "processes": s.processes}
        for side in ("old", "new"):
            ranks = results[side][s.name]
            row[side] = checksum(ranks)
            problems = replica_problems(s, ranks, steps)
            if s.resume and row[side] != checksum(results[side][f"{s.name}_first"]):
                problems.append("the resumed fit does not end where the fit that wrote the checkpoint ends")
            row[f"{side}_problems"] = problems
        row["equal"] = row["old"] == row["new"]
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps={args.steps} is not allowed: expected an integer >= 1")
    settings = [SETTINGS[n] for n in (args.only or SETTINGS)]
    for s in settings:
        if s.resume and args.steps <= epoch_steps(s.processes):
            raise ValueError(
                f"--steps={args.steps} is not allowed with the {s.name} setting: expected more than one epoch "
                f"({epoch_steps(s.processes)} steps) so that the fit can resume after a checkpoint"
            )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="identical_") as tmp:
        commit = extract(args.rev, Path(tmp, "old"))
        rows = compare(Path(tmp, "old"), settings, args.steps, Path(tmp), args.timeout)
    seconds = time.perf_counter() - start
    print(f"final parameters after {args.steps} steps, code at {commit[:7]} (old) and the working tree (new):")
    print("| setting | processes | old | new | equal | replicas |")
    print("| --- | ---: | --- | --- | --- | --- |")
    for r in rows:
        problems = [f"old: {p}" for p in r["old_problems"]] + [f"new: {p}" for p in r["new_problems"]]
        print(
            f"| {r['setting']}: {r['label']} | {r['processes']} | {r['old'][:16]} | {r['new'][:16]} | "
            f"{'yes' if r['equal'] else 'NO'} | {'; '.join(problems) or 'ok'} |"
        )
    failed = [r["setting"] for r in rows if not r["equal"] or r["old_problems"] or r["new_problems"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} settings equal and checked, in {seconds:.0f} s")
    if args.json:
        write_json(args.json, {"rev": commit, "steps": args.steps, "seconds": seconds, "rows": rows})
    return 1 if failed else 0
