"""Where a fault-tolerant replica group finds torchft, its Lighthouse and its place among the groups."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch.distributed as dist

__all__ = ["FT_EXTRA", "ReplicaGroupEnv", "check_fault_tolerance", "group_store", "require_torchft", "torchft_manager"]

#: how to install what ``fault_tolerant=True`` needs
FT_EXTRA = "pip install 'lightning_sparse[ft]'"


def require_torchft() -> ModuleType:
    """torchft, imported; else ImportError naming the extra that installs it."""
    try:
        import torchft
    except ImportError as error:
        raise ImportError(
            f"fault_tolerant=True needs torchft (torchft>=0.2, Linux), which is not installed ({error}); "
            f"install the optional extra: {FT_EXTRA}"
        ) from error
    return torchft


@dataclass(frozen=True)
class ReplicaGroupEnv:
    """This replica group's place among the groups, read from torchft's environment variables.

    Args:
        lighthouse: ``TORCHFT_LIGHTHOUSE``, the Lighthouse's address (``http://host:port``).
        group_id: ``REPLICA_GROUP_ID``, this group's number, ``0 <= group_id < num_groups``.
        num_groups: ``NUM_REPLICA_GROUPS``, the most replica groups there will be (the data's shards).

    Example:
        >>> env = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510", "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3"}
        >>> ReplicaGroupEnv.read(env).group_id
        1
        >>> try:
        ...     ReplicaGroupEnv.read({})
        ... except ValueError as error:
        ...     "TORCHFT_LIGHTHOUSE" in str(error)
        True
    """

    lighthouse: str
    group_id: int
    num_groups: int

    @classmethod
    def read(cls, environ: Any = None) -> ReplicaGroupEnv:
        """The variables from ``environ`` (default: ``os.environ``); a missing or bad one raises
        ValueError naming it and what to set."""
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
            env, "NUM_REPLICA_GROUPS", "the most replica groups there will be (the data is sharded over them)"
        )
        group = _int_var(
            env, "REPLICA_GROUP_ID", f"this replica group's number, 0 to NUM_REPLICA_GROUPS - 1 = {num - 1}"
        )
        if not 0 <= group < num:
            raise ValueError(
                f"REPLICA_GROUP_ID={group} is not allowed with NUM_REPLICA_GROUPS={num}: expected 0 to {num - 1}."
            )
        return cls(lighthouse, group, num)


def _int_var(env: Any, name: str, what: str) -> int:
    raw = env.get(name, "")
    if raw == "":
        raise ValueError(f"fault_tolerant=True needs the environment variable {name}: {what}; it is not set.")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < (1 if name == "NUM_REPLICA_GROUPS" else 0):
        raise ValueError(f"{name}={raw!r} is not allowed: expected a whole number ({what}).")
    return value


def check_fault_tolerance(
    fault_tolerant: Any, min_replicas: Any, quorum_timeout: Any, compress: str, timed_fallback: bool
) -> None:
    """Validate the fault-tolerance settings (with ``fault_tolerant=True``: torchft and the environment too).

    Example:
        >>> check_fault_tolerance(False, 1, 60.0, "update", False)
        >>> try:
        ...     check_fault_tolerance(False, 0, 60.0, "update", False)
        ... except ValueError as error:
        ...     str(error).split(":")[0]
        'min_replicas=0 is not allowed'
    """
    if not isinstance(fault_tolerant, bool):
        raise ValueError(f"fault_tolerant={fault_tolerant!r} is not allowed: expected True or False.")
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(
            f"min_replicas={min_replicas!r} is not allowed: expected a whole number >= 1 (the fewest replica groups "
            "an exchange may run with)."
        )
    t = quorum_timeout
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise ValueError(f"quorum_timeout={t!r} is not allowed: expected a number of seconds > 0.")
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


def torchft_manager(
    env: ReplicaGroupEnv,
    pg: Any,
    healing: tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]],
    min_replicas: int,
    timeout_s: float,
    join: tuple[int, int, str, int],
) -> Any:
    """torchft's ``Manager`` of this process of a replica group (``healing``: the state a healing group
    receives, and how it loads it; ``join``: the process's rank and size in its group, the store's host and port)."""
    from torchft.manager import Manager

    group_rank, group_world, host, port = join
    timeout = timedelta(seconds=timeout_s)
    return Manager(
        pg=pg,
        load_state_dict=healing[1],
        state_dict=healing[0],
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=group_rank,
        world_size=group_world,
        store_addr=host,
        store_port=port,
        lighthouse_addr=env.lighthouse,
        replica_id=f"lightning_sparse_{env.group_id}",
        hostname=host,
        init_sync=True,
    )
