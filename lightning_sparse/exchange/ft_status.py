"""What a replica group that found no quorum learns from the torchft Lighthouse's status page, and its error."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field

from lightning_sparse.exchange.ft_env import ReplicaGroupEnv
from lightning_sparse.exchange.state import ExchangeError
from lightning_sparse.wire.comm import first_line

__all__ = ["HEARTBEAT_GONE_S", "LighthouseView", "ReplicaGroupError", "gist", "no_commit", "no_quorum"]

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


def group_of(replica_id: str) -> int | None:
    """The group number in a replica id ``lightning_sparse_{group}:{uuid}``; None for another's.

    Example:
        >>> group_of("lightning_sparse_2:1271c17e"), group_of("other:1")
        (2, None)
    """
    found = re.match(r"lightning_sparse_(\d+)(?::|$)", replica_id)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class LighthouseView:
    """The Lighthouse's status as its page shows it, by replica group (other replicas left out).

    Args:
        quorum_id: the previous quorum's id; None where none has formed.
        members: the previous quorum's groups and their steps (committed exchanges).
        alive: the groups that sent a heartbeat within :data:`HEARTBEAT_GONE_S`.
        min_replicas: the Lighthouse's ``--min_replicas``, where the page says it.

    Example:
        >>> page = "Previous quorum id: 3 <br> <b>lightning_sparse_0:ab</b> <br/> Step: 60 <br/> need min_replicas 2 "
        >>> LighthouseView.parse(page + "lightning_sparse_0:ab: seen 12.5s ago")
        LighthouseView(quorum_id=3, members={0: 60}, alive=set(), min_replicas=2)
    """

    quorum_id: int | None
    members: dict[int, int] = field(default_factory=dict)
    alive: set[int] = field(default_factory=set)
    min_replicas: int | None = None

    @classmethod
    def parse(cls, page: str) -> LighthouseView:
        """The view of a status page's text (torchft 0.2's layout)."""
        quorum = re.search(r"Previous quorum id:\s*(\d+)", page)
        steps = re.findall(r"<b>([^<\s]+)</b>\s*<br/?>\s*Step:\s*(\d+)", page)
        ages = re.findall(r"(\S+): seen ([\d.]+)(\D+?) ago", page)
        need = re.search(r"need min_replicas (\d+)", page)
        return cls(
            int(quorum.group(1)) if quorum else None,
            {group: int(step) for name, step in steps if (group := group_of(name)) is not None},
            {
                group
                for name, age, unit in ages
                if float(age) * _UNITS.get(unit, 1.0) < HEARTBEAT_GONE_S and (group := group_of(name)) is not None
            },
            int(need.group(1)) if need else None,
        )

    @classmethod
    def fetch(cls, address: str) -> LighthouseView | None:
        """The view of the Lighthouse at ``address`` (``http://host:port``); None where it does not answer."""
        try:
            with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=3.0) as response:
                return cls.parse(response.read().decode("utf-8", "replace"))
        except (OSError, ValueError):
            return None


def explain(view: LighthouseView | None, group: int | None, num_groups: int, patience: float) -> tuple[str, str]:
    """(cause, advice) of a quorum that did not form within ``patience`` seconds, from the Lighthouse's view.

    Example:
        >>> explain(LighthouseView(None), 0, 3, 30.0)[0][:48]
        'no quorum formed within 30 s: no other replica g'
    """
    head = f"no quorum formed within {patience:g} s"
    if view is None:
        return (
            f"{head}, and the Lighthouse's status page did not answer: it may be gone, or no other group is "
            "alive (the run is over, or they have not started)",
            "Check that the Lighthouse runs at that address and that the other groups are alive; if they finished, "
            "the run is over and their final models are its result.",
        )
    alive = sorted(view.alive - {group})
    need = f" (--min_replicas {view.min_replicas})" if view.min_replicas is not None else ""
    if alive:
        return (
            f"{head}, though groups {alive} are alive at the Lighthouse: fewer live groups than the Lighthouse "
            f"asks for{need}, or fewer than this group's min_replicas, or they are stalled",
            "Start the missing groups, or lower the Lighthouse's --min_replicas or the strategy's min_replicas.",
        )
    last = {g: step for g, step in view.members.items() if g != group}
    if view.quorum_id is not None and last:
        return (
            f"{head}: the run is over: the last quorum (id {view.quorum_id}) had groups {sorted(last)}, "
            f"{max(last.values())} exchanges committed, and no other group has sent the Lighthouse a heartbeat for "
            f"{HEARTBEAT_GONE_S:g} s: they reached max_steps, or left",
            "This group does not train on alone from its own state: the run's result is the other groups' final "
            "models (or their checkpoints); to train further, start every group again (from their checkpoints).",
        )
    others = "REPLICA_GROUP_ID 0" + (f" to {num_groups - 1}" if num_groups > 1 else "")
    return (
        f"{head}: no other replica group has reached the Lighthouse{need}",
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
    """The error of a group that found no quorum within ``patience`` seconds, with what the Lighthouse's
    status page says of the other groups."""
    view = LighthouseView.fetch(env.lighthouse) if env is not None else None
    group, num_groups = (env.group_id, env.num_groups) if env is not None else (None, 1)
    cause, advice = explain(view, group, num_groups, patience)
    return ReplicaGroupError("a quorum", env, step, f"{cause} (torchft: {gist(error)})", advice)


def no_commit(env: ReplicaGroupEnv | None, step: int, error: Exception) -> ReplicaGroupError:
    """The error of a group whose commit vote (torchft's ``should_commit``) failed."""
    return ReplicaGroupError(
        "its exchange's commit vote (torchft's should_commit)", env, step,
        f"it failed ({gist(error)}): a process of this group did not vote in time (it died or stalled)",
        "Look at the logs of the group's other processes; start the group again: it heals from the others.",
    )  # fmt: skip
