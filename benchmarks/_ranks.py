"""Start a benchmark's ranks as processes and wait for them under one deadline."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from lightning_sparse._utils import free_port  # below the ephemeral ports: see its docstring

__all__ = ["CHECKOUT", "checkout_env", "free_port", "run_ranks"]

#: the checkout that holds this package (it is not installed): the processes a benchmark starts
#: with ``python -m benchmarks ...`` import it from there
CHECKOUT = Path(__file__).resolve().parent.parent


def checkout_env(env: dict[str, str], package: Path | None = None) -> dict[str, str]:
    """A copy of ``env`` with the checkout first on ``PYTHONPATH``: a process started with it finds
    the ``benchmarks`` package from any working directory. With ``package`` (a folder holding a
    ``lightning_sparse``, e.g. one from :func:`benchmarks._revs.extract`) before it, the process
    imports that package rather than the checkout's."""
    first = [] if package is None else [str(package)]
    paths = [*first, str(CHECKOUT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def run_ranks(
    cmds: list[list[str]], env: dict[str, str], logs: list[Path], timeout: float, package: Path | None = None
) -> tuple[list[int], bool]:
    """Run one process per command (the checkout on their ``PYTHONPATH``), each writing its output to
    its log; wait at most ``timeout`` seconds for all of them and kill those still running then (a
    hung collective). With ``package``, they import ``lightning_sparse`` from that folder (see
    :func:`checkout_env`) and start in their log's folder (``python -m`` puts the working directory
    first on the path, and the checkout's package would come from there).

    Returns the exit codes and whether the deadline passed.
    """
    env = checkout_env(env, package)
    procs = []
    for cmd, path in zip(cmds, logs, strict=True):
        cwd = None if package is None else path.parent
        with open(path, "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd))
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [proc.returncode for proc in procs], timed_out
