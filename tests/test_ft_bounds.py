"""Fault-tolerant replica groups never hang: a group alone, a group sent SIGTERM at its quorum and a
group that comes back after the others have finished each end, non-zero, with a line saying why.
Real Lighthouse, real jobs (tests/ft_worker.py), as in tests/test_ft.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from _dist import skip_without_ft  # noqa: E402

skip_without_ft()

from test_ft import CONFIG, Groups  # noqa: E402

pytestmark = pytest.mark.dist
FSDP = {"strategy": "fsdp", "devices": 2}
# the sparse_fsdp groups (2 processes each, about a minute a test) run with -m slow
KINDS = [pytest.param({}, id="ddp"), pytest.param(FSDP, id="sparse_fsdp_2_processes", marks=pytest.mark.slow)]


def _session(leader: int) -> list[int]:
    """The live (not zombie) processes of the session ``leader`` started: a group's launcher and its ranks."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == leader and fields[0] != "Z":
            found.append(int(entry))
    return found


def _ends(groups: Groups, group: int, within: float, began: float) -> int:
    """The exit status of the group's launcher, which must end ``within`` seconds of ``began``, and all
    of its processes with it (a few seconds later at most)."""
    proc = groups.procs[group]
    try:
        code = proc.wait(timeout=max(0.1, began + within - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"group {group} still running {within} s on:\n{groups.log(group)}") from None
    end = time.monotonic() + 5
    while _session(proc.pid) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _session(proc.pid), f"processes of group {group} left behind: {_session(proc.pid)}"
    return code


def _processes_of(groups: Groups, group: int, count: int) -> None:
    groups.wait_for(f"the {count} processes of group {group}", lambda: len(_session(groups.procs[group].pid)) >= count)


@pytest.mark.parametrize("kind", KINDS)
def test_a_group_alone_ends_within_a_minute_saying_why(tmp_path: Path, kind: dict[str, Any]) -> None:
    """The Lighthouse asks for 2 groups and no other comes: the first quorum waits quorum_timeout (at least 20 s)."""
    groups = Groups(tmp_path, {**CONFIG, **kind, "quorum_timeout": 20.0}, 3, min_replicas=2)
    try:
        began = time.monotonic()
        groups.start(0)
        code = _ends(groups, 0, 60, began)
    finally:
        groups.close()
    log = groups.log(0, tail=10**7)
    assert code != 0, log
    assert "ReplicaGroupError: lightning_sparse: replica group 0 waited for a quorum at its step 0" in log, log
    assert f"TORCHFT_LIGHTHOUSE='{groups.address}'" in log and "no quorum formed within 20 s" in log
    assert "no other replica group has reached the Lighthouse (--min_replicas 2)" in log
    assert "Start the other groups (REPLICA_GROUP_ID 0 to 2" in log


@pytest.mark.parametrize("kind", KINDS)
def test_sigterm_at_the_quorum_ends_the_group_within_10_s(tmp_path: Path, kind: dict[str, Any]) -> None:
    """SIGTERM to the group's launcher alone (as a scheduler may send it): it and its other processes go."""
    groups = Groups(tmp_path, {**CONFIG, **kind, "quorum_timeout": 120.0}, 2, min_replicas=2)
    try:
        groups.start(0)
        groups.wait_for("group 0 at its quorum", lambda: "All workers joined - starting quorum" in groups.log(0), 120)
        time.sleep(1.0)
        began = time.monotonic()
        os.kill(groups.procs[0].pid, signal.SIGTERM)
        code = _ends(groups, 0, 10, began)
    finally:
        groups.close()
    log = groups.log(0, tail=10**7)
    assert code == 128 + signal.SIGTERM, log
    assert "lightning_sparse: replica group 0 (process 0 of" in log
    assert "got SIGTERM while waiting for a quorum: leaving the replica groups and exiting with status 143" in log


@pytest.mark.parametrize("kind", KINDS)
def test_a_group_back_after_the_others_finished_is_told_the_run_is_over(tmp_path: Path, kind: dict[str, Any]) -> None:
    config = {**CONFIG, **kind, "max_steps": 24, "step_sleep": 0.0, "quorum_timeout": 20.0}
    groups = Groups(tmp_path, config, 2, min_replicas=2)
    try:
        groups.start(0)
        groups.start(1)
        groups.finish([0, 1])
        groups.start(1)  # the same command again, after the run
        # from its quorum's start: a loaded 2-core machine takes up to a minute to launch a group of 2
        waits = lambda: "starting quorum" in (tmp_path / "log_g1_1.txt").read_text(errors="replace")  # noqa: E731
        groups.wait_for("group 1 at its quorum again", waits, 180)
        code = _ends(groups, 1, 20 + 30, time.monotonic())
    finally:
        groups.close()
    log = groups.log(1, tail=10**7)
    assert code != 0, log
    assert "replica group 1 waited for a quorum at its step 0" in log
    assert "the run is over: the last quorum (id" in log and "had groups [0], " in log and "exchanges committed" in log
    assert "This group does not train on alone from its own state" in log
