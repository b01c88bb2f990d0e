"""Start a benchmark's ranks as processes and wait for them under one deadline."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def run_ranks(cmds: list[list[str]], env: dict[str, str], logs: list[Path], timeout: float) -> tuple[list[int], bool]:
    """Run one process per command, each writing its output to its log; wait at most ``timeout``
    seconds for all of them and kill those still running then (a hung collective).

    Returns the exit codes and whether the deadline passed.
    """
    procs = []
    for cmd, path in zip(cmds, logs, strict=True):
        with open(path, "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
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
