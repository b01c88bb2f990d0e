"""Run a worker script against the package as it is at a git revision, or as it is in the tree.

A worker is a script of ``benchmarks/`` (``python benchmarks/X_worker.py config.json``) that imports
no ``benchmarks`` module: started as a script, with only the folder of the package under test on
``PYTHONPATH``, it imports that ``lightning_sparse`` and no other. It checks where the package came
from (``config["package_root"]``: ``benchmarks/_worker.py``) and writes ``{run}_rank{r}.json`` files into
``config["out"]``; Lightning's launcher (Trainer or Fabric) starts the other ranks.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from benchmarks._ranks import CHECKOUT, free_port


def resolve(rev: str) -> str:
    """The commit ``rev`` names in this checkout's git repository (``ValueError`` if none).

    Example:
        >>> len(resolve("HEAD"))
        40
    """
    found = subprocess.run(
        ["git", "-C", str(CHECKOUT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise ValueError(f"--rev={rev!r} is not allowed: expected a commit of the git repository at {CHECKOUT}")
    return found.stdout.strip()


def extract(rev: str, into: Path) -> str:
    """Write the package ``lightning_sparse/`` as it is at ``rev`` under ``into`` (``git archive``);
    return the commit."""
    commit = resolve(rev)
    archive = subprocess.run(
        ["git", "-C", str(CHECKOUT), "archive", "--format=tar", commit, "lightning_sparse"],
        capture_output=True,
        check=True,
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return commit


def run_worker(
    worker: Path, root: Path, config: dict[str, Any], work: Path, timeout: float
) -> dict[str, list[dict[str, Any]]]:
    """Run ``worker`` with the package under ``root`` (alone on ``PYTHONPATH``; one thread per
    process, a fixed hash seed) on ``config`` (``out`` and ``package_root`` added), in ``work`` (a
    new folder, which keeps the log). Returns every rank's results by run name, ordered by rank:
    ``config["runs"]`` lists the runs, each a dict with a ``name``."""
    work.mkdir(parents=True)
    config = {**config, "out": str(work), "package_root": str(root)}
    (work / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(
        {
            "PYTHONPATH": str(root),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1",
            "PYTHONHASHSEED": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    with open(work / "log.txt", "w") as log:
        done = subprocess.run(
            [sys.executable, str(worker), str(work / "config.json")],
            cwd=work,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    if done.returncode != 0:
        tail = (work / "log.txt").read_text()[-4000:]
        raise RuntimeError(f"{worker.name} with the package at {root} failed (exit code {done.returncode}):\n{tail}")
    results: dict[str, list[dict[str, Any]]] = {}
    for run in config["runs"]:
        paths = sorted(work.glob(f"{run['name']}_rank*.json"), key=lambda p: int(p.stem.rpartition("rank")[2]))
        results[run["name"]] = [json.loads(p.read_text()) for p in paths]
    return results
