"""Where a fault-tolerant replica group finds torchft, its Lighthouse and its place among the groups."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_sparse._utils import TORCH_FOR_FT, torch_at_least

__all__ = ["ReplicaGroupEnv", "check_fault_tolerance", "group_store", "require_torchft", "shard_across_groups"]


def require_torchft() -> None:
    """Import torchft; without it, ImportError naming the extra that installs it. A torch before 2.8 is refused
    (RuntimeError): torchft 0.2's gloo groups set an option field that 2.7 lacks."""
    try:
        import torchft  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"fault_tolerant=True needs torchft (torchft>=0.2, Linux), which is not installed ({error}); "
            "install the optional extra: pip install 'lightning_sparse[ft]'"
        ) from error
    if not torch_at_least(TORCH_FOR_FT):
        raise RuntimeError(
            f"fault_tolerant=True needs torch >= {TORCH_FOR_FT} (torchft's process groups); this is torch "
            f"{torch.__version__}."
        )


@dataclass(frozen=True)
class ReplicaGroupEnv:
    """This replica group's place among the groups, read from torchft's environment variables.

    Args:
        lighthouse: ``TORCHFT_LIGHTHOUSE``, the Lighthouse's address (``http://host:port``).
        group_id: ``REPLICA_GROUP_ID``, this group's number, ``0 <= group_id < num_groups``.
        num_groups: ``NUM_REPLICA_GROUPS``, the most replica groups there will be (the data's shards).

    Example:
        >>> env = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510", "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3"}
        >>> ReplicaGroupEnv.read(env)
        ReplicaGroupEnv(lighthouse='http://127.0.0.1:29510', group_id=1, num_groups=3)
    """

    lighthouse: str
    group_id: int
    num_groups: int

    @classmethod
    def read(cls, environ: Any = None) -> ReplicaGroupEnv:
        """The variables from ``environ`` (default ``os.environ``); a missing or bad one raises ValueError naming it."""
        env = os.environ if environ is None else environ
        lighthouse = env.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise ValueError(
                "fault_tolerant=True needs the environment variable TORCHFT_LIGHTHOUSE: the address of the torchft "
                "Lighthouse every replica group meets at (start one with `torchft_lighthouse --min_replicas 1 "
                "--bind [::]:29510`, then set TORCHFT_LIGHTHOUSE=http://HOST:29510); it is not set."
            )
        if "://" not in lighthouse:
            raise ValueError(
                f"TORCHFT_LIGHTHOUSE={lighthouse!r} is not allowed: expected an address like http://HOST:PORT."
            )
        num = _int_var(
            env, "NUM_REPLICA_GROUPS", "the most replica groups there will be (the data is sharded over them)", 1
        )
        group = _int_var(
            env, "REPLICA_GROUP_ID", f"this replica group's number, 0 to NUM_REPLICA_GROUPS - 1 = {num - 1}", 0
        )
        if not 0 <= group < num:
            raise ValueError(
                f"REPLICA_GROUP_ID={group} is not allowed with NUM_REPLICA_GROUPS={num}: expected 0 to {num - 1}."
            )
        return cls(lighthouse, group, num)


def _int_var(env: Any, name: str, what: str, minimum: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        raise ValueError(f"fault_tolerant=True needs the environment variable {name}: {what}; it is not set.")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < minimum:
        raise ValueError(f"{name}={raw!r} is not allowed: expected a whole number ({what}).")
    return value


def check_fault_tolerance(
    fault_tolerant: Any, min_replicas: Any, quorum_timeout: Any, compress: str, timed_fallback: bool
) -> None:
    """Validate the fault-tolerance settings (with ``fault_tolerant=True``: torchft and the environment too).

    Example:
        >>> check_fault_tolerance(False, 1, 60.0, "update", False)
    """
    if not isinstance(fault_tolerant, bool):
        raise ValueError(f"fault_tolerant={fault_tolerant!r} is not allowed: expected True or False.")
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(
            f"min_replicas={min_replicas!r} is not allowed: expected a whole number >= 1 (the fewest replica groups "
            "an exchange may run with)."
        )
    if isinstance(quorum_timeout, bool) or not isinstance(quorum_timeout, (int, float)) or not quorum_timeout > 0:
        raise ValueError(f"quorum_timeout={quorum_timeout!r} is not allowed: expected a number of seconds > 0.")
    if not fault_tolerant:
        return
    if compress != "update":
        raise ValueError(
            f"fault_tolerant=True is not allowed with compress={compress!r}: replica groups meet at the exchanges "
            "of update mode; use compress='update' (with sync_every > 1 the groups need each other only there)."
        )
    if timed_fallback:
        raise ValueError(
            "fault_tolerant=True is not allowed with fallback_to_dense='time': its plain DDP steps all-reduce "
            "gradients inside one job; use fallback_to_dense=True or False."
        )
    require_torchft()
    ReplicaGroupEnv.read()


def shard_across_groups(kwargs: dict[str, Any], fault_tolerant: bool) -> dict[str, Any]:
    """A DistributedSampler's ``num_replicas``/``rank`` over every replica group's processes, as torchft's."""
    if not fault_tolerant:
        return kwargs
    env = ReplicaGroupEnv.read()
    inside = int(kwargs["num_replicas"])
    return {**kwargs, "num_replicas": inside * env.num_groups, "rank": int(kwargs["rank"]) + inside * env.group_id}


def group_store(group: dist.ProcessGroup | None, group_rank: int, group_world: int) -> tuple[Any, str, int]:
    """This replica group's torchft store: its process 0 starts it, the others learn its port (one broadcast).
    Returns the store (None on the other processes), its host and its port."""
    from torch.distributed import TCPStore

    host, store, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), None, [0]
    if group_rank == 0:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        port = [store.port]
    if group_world > 1:
        source = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(port, src=source, group=group)
    return store, host, port[0]
