"""The commit of update-mode exchanges among replica groups (one job each) on torchft: quorum, rollback, healing."""

from __future__ import annotations

import contextlib
import copy
import os
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_sparse.exchange.fragment import InFlight
from lightning_sparse.exchange.ft_env import ReplicaGroupEnv, group_store, require_torchft
from lightning_sparse.exchange.ft_guard import Guard
from lightning_sparse.exchange.ft_status import gist, no_commit, no_quorum
from lightning_sparse.exchange.update import UpdateExchange
from lightning_sparse.wire import Collectives

__all__ = ["FrontEndState", "ReplicaCommit"]

#: a process's first quorum waits ``quorum_timeout``, at least this many seconds: the others may still be starting
STARTUP_FLOOR_S = 20.0
#: a front end's part of the state a healing group receives: (save, load)
FrontEndState = tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]


class ReplicaCommit:
    """The commit of one replica group's update exchange among the live groups, on torchft's ``Manager``.

    Before each exchange it asks torchft's Lighthouse for a quorum of the live groups (a group behind heals from a
    healthy one, its residual zero); process ``r`` of each group exchanges with process ``r`` of the others, and an
    exchange that does not commit everywhere (``should_commit``) is rolled back. An
    :class:`~lightning_sparse.exchange.update.UpdateExchange` given it as ``commit`` calls it.

    Args:
        min_replicas: the fewest replica groups an exchange runs with; with fewer the group waits.
        quorum_timeout: seconds a quorum, a collective or a recovery may take.

    Example:
        >>> from lightning_sparse.exchange.state import SparseState
        >>> commit = ReplicaCommit(min_replicas=2)
        >>> exchange = UpdateExchange(SparseState(compressor="topk", density=0.5), commit=commit)
        >>> exchange.active, commit.commits, commit.rollbacks, commit.exchange is exchange
        (True, 0, 0, True)
    """

    def __init__(self, min_replicas: int = 1, quorum_timeout: float = 60.0) -> None:
        #: the exchange it commits (set by the exchange it is given to)
        self.exchange: UpdateExchange | None = None
        self.min_replicas = int(min_replicas)
        self.quorum_timeout = float(quorum_timeout)
        #: the front end's part of the healing state (optimizer states, step counters)
        self.front_end: FrontEndState | None = None
        #: optimizer steps this group has taken; a healing group takes a healthy one's
        self.steps = 0
        #: exchanges committed, rolled back; recoveries from a peer; groups in the last quorum
        self.commits = self.rollbacks = self.heals = self.participants = 0
        #: seconds spent waiting for quorums
        self.quorum_seconds = 0.0
        self.manager: Any = None
        self.env: ReplicaGroupEnv | None = None
        self._pg: Any = None
        self._store: Any = None  # this group's torchft store (on its process 0), kept open
        self._address: tuple[str, int] | None = None  # the store's, once started
        self._quorum_at: int | None = None
        self._open = False  # a quorum waits for its should_commit
        self._awaiting: InFlight | None = None  # sync_delay: the quorum's exchange, committed on arrival
        self._guard: Guard | None = None
        self._where = (0, 1)  # this process's rank and size in its group

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(manager=None, _pg=None, _store=None, front_end=None, _awaiting=None, _guard=None, _address=None)
        return state

    @property
    def _update(self) -> UpdateExchange:
        if self.exchange is None:
            raise RuntimeError("ReplicaCommit: give it to an UpdateExchange (commit=) before it exchanges")
        return self.exchange

    def start(
        self, group: dist.ProcessGroup | None, group_rank: int, group_world: int, front_end: FrontEndState | None = None
    ) -> None:
        """Prepare to join the replica groups: this group's store and torchft's process group (the ``Manager``
        follows at the first quorum). ``front_end``: what a healing group takes besides the exchange's state."""
        self.front_end = front_end
        if self._address is not None:
            return
        require_torchft()
        from torchft.process_group import ProcessGroupGloo

        self.env = ReplicaGroupEnv.read()
        self._where = (group_rank, group_world)
        self._guard = Guard(self._describe)
        self._guard.install()
        os.environ.setdefault("RUST_LOG", "warn")
        self._store, host, port = group_store(group, group_rank, group_world)
        self._pg = ProcessGroupGloo(timeout=timedelta(seconds=self.quorum_timeout))
        self._address = (host, port)

    def _join_groups(self) -> None:
        """Build torchft's ``Manager`` at the first quorum, not at setup: its heartbeats count this group, and a
        group still setting up would hold the others' quorums."""
        from torchft.manager import Manager

        assert self._address is not None and self.env is not None
        env, (host, port), timeout = self.env, self._address, timedelta(seconds=self.quorum_timeout)
        reach = "the Lighthouse and this group's torchft store"
        try:
            with self._waiting(reach, max(self.quorum_timeout, STARTUP_FLOOR_S)):
                self.manager = Manager(
                    pg=self._pg,
                    load_state_dict=self._load_state_dict,
                    state_dict=self._state_dict,
                    min_replica_size=self.min_replicas,
                    use_async_quorum=False,
                    timeout=timeout,
                    quorum_timeout=timeout,
                    connect_timeout=timeout,
                    rank=self._where[0],
                    world_size=self._where[1],
                    store_addr=host,
                    store_port=port,
                    lighthouse_addr=env.lighthouse,
                    replica_id=f"lightning_sparse_{env.group_id}",
                    hostname=host,
                    init_sync=True,
                )
        except Exception as error:
            raise RuntimeError(
                f"lightning_sparse: replica group {env.group_id} could not reach the torchft Lighthouse at "
                f"TORCHFT_LIGHTHOUSE={env.lighthouse!r} ({gist(error)}); start it with `torchft_lighthouse "
                "--min_replicas 1 --bind [::]:PORT` and set TORCHFT_LIGHTHOUSE=http://HOST:PORT."
            ) from error

    def close(self) -> None:
        """Leave the groups (the Manager's servers end)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        if self._pg is not None:  # gloo's context and threads end here, not in the interpreter's teardown
            self._pg.shutdown()  # (the next quorum's configure() makes a new one)
        if self._guard is not None:
            self._guard.close()
            self._guard = None

    def _waiting(self, what: str, bound: float) -> contextlib.AbstractContextManager[None]:
        return self._guard.waiting(what, bound) if self._guard is not None else contextlib.nullcontext()

    def _describe(self) -> str:
        rank, world = self._where
        return f"replica group {self._group_id()} (process {rank} of {world}) at its step {self.steps}"

    def _due(self) -> bool:
        state = self._update.state
        h = state.config.sync_every
        return not state.cycle or any(v + 1 >= h for v in state.cycle.values())

    @torch.no_grad()
    def before_step(self) -> None:
        """Before an optimizer step at which an exchange is due (and the first): the quorum."""
        if self.manager is None and self._address is not None:
            self._join_groups()
        if self.manager is not None and self._quorum_at != self.steps and (self._quorum_at is None or self._due()):
            self._quorum_at = self.steps
            self._quorum()
            if not self._due():
                # the first step, not an exchange's: nothing to commit (the state is served until fetched)
                self._open = False

    def _quorum(self) -> None:
        """A quorum of at least ``min_replicas`` live groups; the collectives then go over torchft's process group."""
        manager = self.manager
        began = time.perf_counter()
        self._update.land_due()  # before the process group reconfigures
        patience = self.quorum_timeout if self.participants else max(self.quorum_timeout, STARTUP_FLOOR_S)
        deadline = time.monotonic() + patience
        with self._waiting("a quorum", patience + 2 * self.quorum_timeout):
            while True:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise TimeoutError(
                            f"only {manager.num_participants()} groups, min_replicas={self.min_replicas}"
                        )
                    manager.start_quorum(timeout=timedelta(seconds=left))
                except Exception as error:
                    raise no_quorum(self.env, self.steps, patience, error) from error
                if manager.num_participants() >= self.min_replicas:
                    break
                self._commit()  # too few groups: commit nothing, ask again
                time.sleep(0.1)
        self.quorum_seconds += time.perf_counter() - began
        self._open = True
        self.participants = manager.num_participants()
        rank = manager.participating_rank()
        self._update.state.use_collectives(Collectives(self._pg, self.participants), 0 if rank is None else rank)

    def _commit(self) -> bool:
        self._open = False
        with self._waiting("its exchange's commit vote", self.quorum_timeout):
            try:
                return bool(self.manager.should_commit())
            except Exception as error:
                raise no_commit(self.env, self.steps, error) from error

    @torch.no_grad()
    def run_exchange(self, exchange: Callable[[], None]) -> None:
        """After the optimizer step: ``exchange`` among the quorum (committed everywhere, or rolled back)."""
        self.steps += 1
        if not self._open:
            exchange()
            return
        update = self._update
        saved = update.snapshot()
        flights = len(update.in_flight)
        error = self._attempt("its exchange's collectives", exchange)
        if error is None and len(update.in_flight) > flights:  # sync_delay: committed where it arrives
            self._awaiting, self._open = update.in_flight[-1], False
            return
        if error is None and self.manager.current_step() == 0:
            # before the first commit: the first group serves its state (init_sync) only until then, so this
            # barrier holds it until the others have fetched it
            self._attempt(
                "the quorum's first barrier", lambda: self._pg.allreduce([torch.zeros(1)], dist.ReduceOp.SUM).wait()
            )
        self._settle(error, lambda: self._rollback(saved), "residuals, global model and outer step as before it")

    def _attempt(self, what: str, action: Callable[[], Any]) -> Exception | None:
        """Run ``action`` within ``quorum_timeout``; a failure (a group died or stalled) is reported and returned."""
        try:
            with self._waiting(what, self.quorum_timeout):
                action()
        except Exception as error:
            self.manager.report_error(error)
            return error
        return None

    def _settle(self, error: Exception | None, rollback: Callable[[], None], what: str) -> bool:
        """Commit the exchange everywhere, or ``rollback`` and say so; returns whether it committed."""
        if self._commit():
            self.commits += 1
            return True
        self.rollbacks += 1
        rollback()
        cause = gist(error) if error is not None else "another group's collective failed"
        warnings.warn(
            f"lightning_sparse: replica group {self._group_id()}'s exchange {self._update.state.step + 1} did not "
            f"commit ({cause}); rolled back: {what}. A group that died or stalled longer than quorum_timeout is "
            "dropped; the next exchange runs with the new quorum.",
            stacklevel=2,
        )
        return False

    def commits_flight(self, flight: InFlight) -> bool:
        """An exchange in flight arrives: whether it is applied (committed), or nothing of it is and ``e = u``."""
        if flight is not self._awaiting:
            return True
        self._awaiting = None
        error = self._attempt("its exchange's collectives", lambda: _arrive(flight))
        memory = self._update.state.memory

        def rollback() -> None:
            for bucket in flight.buckets:
                bucket.put_residuals(bucket.pending_buffer(), memory)
                memory.unstage(bucket.names)

        return self._settle(
            error, rollback, "its sent part back in the residuals, global model and outer step unchanged"
        )

    @torch.no_grad()
    def run_flush(self, rounds: int | None, flush: Callable[[], None]) -> None:
        """The exact hand-over (``flush``) among the live groups, committed or rolled back (residuals then kept)."""
        if rounds is not None:
            raise ValueError(
                f"flush_residuals(rounds={rounds!r}) is not allowed with fault_tolerant=True: expected rounds=None "
                "(the exact hand-over, one quorum); the residuals otherwise go with the next exchanges"
            )
        if self.manager is None:
            return
        update = self._update
        try:
            self._quorum()
        except RuntimeError as missed:
            update.hold_global()
            warnings.warn(
                f"lightning_sparse: replica group {self._group_id()} kept its residuals at the hand-over: "
                f"{gist(missed)}. The global model is as the last exchange left it.",
                stacklevel=3,
            )
            return
        saved = update.snapshot()
        error = self._attempt("the hand-over's collectives", flush)

        def rollback() -> None:
            self._rollback(saved)
            update.hold_global()

        self._settle(error, rollback, "the residuals kept, the global model as the last exchange left it")

    def _rollback(self, saved: dict[str, Any]) -> None:
        self._awaiting = None
        self._update.restore(saved)

    def _state_dict(self) -> dict[str, Any]:
        """What a group that heals from this one receives (copies: served while this group goes on)."""
        update = self._update
        sparse = update.state.state_dict(copy=True)
        sparse["residuals"], sparse["velocity"] = {}, {}
        return {
            "global": update.global_values(cpu=True),
            "outer": copy.deepcopy(update.outer_step.state_dict()),
            "sparse": sparse,
            "steps": self.steps,
            "front_end": copy.deepcopy(self.front_end[0]()) if self.front_end is not None else {},
        }

    @torch.no_grad()
    def _load_state_dict(self, received: dict[str, Any]) -> None:
        """Heal from a healthy group's state; the residual starts at zero."""
        self._awaiting = None
        if self.steps:
            warnings.warn(
                f"lightning_sparse: replica group {self._group_id()} was behind the quorum at its step {self.steps} "
                f"(the others at step {received['steps']}): the other groups dropped it (it stalled longer than "
                f"quorum_timeout={self.quorum_timeout:g} s, or its exchange failed), so it healed from a healthy "
                "group; its unsent progress (residual) starts again at zero.",
                stacklevel=2,
            )
        update = self._update
        update.state.load_state_dict(received["sparse"])
        update.state.memory.clear()
        update.outer_step.load_state_dict(received["outer"])
        update.load_global_values(received["global"])
        self.steps = int(received["steps"])
        self._quorum_at = self.steps
        if self.front_end is not None:
            self.front_end[1](received["front_end"])
        self.heals += 1

    def replica_figures(self) -> dict[str, float]:
        """``sparse/replica_groups`` (groups in the last quorum), ``sparse/rollbacks``, ``sparse/heals``."""
        counts = {"replica_groups": self.participants, "rollbacks": self.rollbacks, "heals": self.heals}
        return {f"sparse/{name}": float(count) for name, count in counts.items()}

    def _group_id(self) -> int | None:
        return None if self.env is None else self.env.group_id


def _arrive(flight: InFlight) -> None:
    for future in flight.futures:
        future.wait().ready()
