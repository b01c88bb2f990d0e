"""What a replica group that found no quorum learns from the torchft Lighthouse's status page, and its error."""

from __future__ import annotations

import re
import urllib.request

from lightning_sparse.exchange.ft_env import ReplicaGroupEnv
from lightning_sparse.exchange.state import ExchangeError
from lightning_sparse.wire.comm import first_line

__all__ = ["HEARTBEAT_GONE_S", "ReplicaGroupError", "explain", "gist", "no_commit", "no_quorum", "status_page"]

#: a group whose last heartbeat at the Lighthouse is older than this many seconds counts as gone
HEARTBEAT_GONE_S = 5.0
_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class ReplicaGroupError(ExchangeError):
    """A replica group's wait at the Lighthouse or among the groups did not end in time (and what to do).

    Example:
        >>> env = ReplicaGroupEnv("http://h:29510", 2, 3)
        >>> error = ReplicaGroupError("a quorum", env, 12, "none formed within 30 s", "Start them.")
        >>> isinstance(error, ExchangeError), str(error)[:58]
        (True, 'lightning_sparse: replica group 2 waited for a quorum at i')
    """

    def __init__(self, what: str, env: ReplicaGroupEnv | None, step: int, cause: str, advice: str) -> None:
        group, lighthouse = (env.group_id, env.lighthouse) if env is not None else (None, None)
        RuntimeError.__init__(
            self,
            f"lightning_sparse: replica group {group} waited for {what} at its step {step} (Lighthouse "
            f"TORCHFT_LIGHTHOUSE={lighthouse!r}): {cause}. {advice}",
        )


def _group_of(replica_id: str, exclude: int | None) -> int | None:
    """The group number in a replica id ``lightning_sparse_{group}:{uuid}``; None for another job's, or ``exclude``."""
    found = re.match(r"lightning_sparse_(\d+)(?::|$)", replica_id)
    return int(found.group(1)) if found and int(found.group(1)) != exclude else None


def status_page(address: str) -> str | None:
    """The text of the Lighthouse's status page at ``address`` (``http://host:port``); None where it does not answer."""
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=3.0) as response:
            return str(response.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def explain(page: str | None, group: int | None, num_groups: int, patience: float) -> tuple[str, str]:
    """(cause, advice) of a quorum that did not form within ``patience`` seconds, from the Lighthouse's status
    ``page`` (torchft 0.2's layout: the previous quorum and every replica's last heartbeat).

    Example:
        >>> page = "Previous quorum id: 3 <br> <b>lightning_sparse_0:ab</b> <br/> Step: 60 <br/> need min_replicas 2 "
        >>> explain(page + "lightning_sparse_0:ab: seen 12.5s ago", 1, 2, 30.0)[0][:78]
        'no quorum formed within 30 s: the run is over: the last quorum (id 3) had grou'
    """
    head = f"no quorum formed within {patience:g} s"
    if page is None:
        return (
            f"{head}, and the Lighthouse's status page did not answer: it may be gone, or no other group is "
            "alive (the run is over, or they have not started)",
            "Check that the Lighthouse runs at that address and that the other groups are alive; if they finished, "
            "the run is over and their final models are its result.",
        )
    seen = re.findall(r"(\S+): seen ([\d.]+)(\D+?) ago", page)
    ages = {name: float(age) * _UNITS.get(unit, 1.0) for name, age, unit in seen}
    alive = {g for name, age in ages.items() if age < HEARTBEAT_GONE_S and (g := _group_of(name, group)) is not None}
    need = re.search(r"need min_replicas (\d+)", page)
    needs = f" (--min_replicas {need.group(1)})" if need else ""
    if alive:
        return (
            f"{head}, though groups {sorted(alive)} are alive at the Lighthouse: fewer live groups than the "
            f"Lighthouse asks for{needs}, or fewer than this group's min_replicas, or they are stalled",
            "Start the missing groups, or lower the Lighthouse's --min_replicas or the strategy's min_replicas.",
        )
    quorum = re.search(r"Previous quorum id:\s*(\d+)", page)
    members = dict(re.findall(r"<b>([^<\s]+)</b>\s*<br/?>\s*Step:\s*(\d+)", page))  # replica id: its step
    last = {g: int(step) for name, step in members.items() if (g := _group_of(name, group)) is not None}
    if quorum and last:
        return (
            f"{head}: the run is over: the last quorum (id {int(quorum.group(1))}) had groups {sorted(last)}, "
            f"{max(last.values())} exchanges committed, and no other group has sent the Lighthouse a heartbeat for "
            f"{HEARTBEAT_GONE_S:g} s: they reached max_steps, or left",
            "This group does not train on alone from its own state: the run's result is the other groups' final "
            "models (or their checkpoints); to train further, start every group again (from their checkpoints).",
        )
    others = "REPLICA_GROUP_ID 0" + (f" to {num_groups - 1}" if num_groups > 1 else "")
    return (
        f"{head}: no other replica group has reached the Lighthouse{needs}",
        f"Start the other groups ({others}, the same TORCHFT_LIGHTHOUSE) within quorum_timeout of this one, "
        "or raise quorum_timeout.",
    )


def gist(error: BaseException) -> str:
    """An error's :func:`~lightning_sparse.wire.comm.first_line`, at most 300 characters.

    Example:
        >>> gist(TimeoutError("timed out after 3 s")), gist(KeyError())
        ('timed out after 3 s', 'KeyError')
    """
    return first_line(error)[:300]


def no_quorum(env: ReplicaGroupEnv | None, step: int, patience: float, error: Exception) -> ReplicaGroupError:
    """A group's error for no quorum in ``patience`` seconds, with what the Lighthouse's status page says."""
    page = status_page(env.lighthouse) if env is not None else None
    group, num_groups = (env.group_id, env.num_groups) if env is not None else (None, 1)
    cause, advice = explain(page, group, num_groups, patience)
    return ReplicaGroupError("a quorum", env, step, f"{cause} (torchft: {gist(error)})", advice)


def no_commit(env: ReplicaGroupEnv | None, step: int, error: Exception) -> ReplicaGroupError:
    """The error of a group whose commit vote (torchft's ``should_commit``) failed."""
    return ReplicaGroupError(
        "its exchange's commit vote (torchft's should_commit)", env, step,
        f"it failed ({gist(error)}): a process of this group did not vote in time (it died or stalled)",
        "Look at the logs of the group's other processes; start the group again: it heals from the others.",
    )  # fmt: skip
