"""Torch's own DDP communication hooks (PowerSGD, fp16, bf16) as reference rows of the benchmarks.

``bench convergence`` trains with them through Lightning; ``bench step`` times them on raw DDP models.

Lightning's ``DDPStrategy`` registers its ``ddp_comm_hook`` only when the device is CUDA; on CPU the
hook is silently never called. ``CommHookDDPStrategy`` registers it on every device, so these peers
run on the same CPU/gloo fits as ``SparseDDPStrategy``. ``CollectiveCounter`` counts the bytes the
hooks hand to ``torch.distributed`` collectives.

PowerSGD issues its second and third all-reduce of a bucket from future callbacks, which run on
gloo's threads: with several buckets those of different buckets interleave differently on each
rank, and gloo aborts ("Received data size doesn't match expected size"; seen with the 3.2M-parameter
gpt task on 2 CPU ranks). ``SequentialHook`` runs the hook of one bucket only after the previous
bucket's future completed, so every rank issues the same collectives in the same order; the math and
the bytes are torch's, only the overlap of buckets is lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

#: ``--peers`` names: ``powersgd[:RANK]`` (bare ``powersgd``: rank 4), ``fp16``, ``bf16``
PEER_HELP = "powersgd[:RANK], fp16 or bf16"
DEFAULT_POWERSGD_RANK = 4
#: PowerSGD's first compressed step: torch requires > 1 with error feedback or warm start (DDP's first
#: iterations rebuild its buckets); the steps before it are plain all-reduces
POWERSGD_START_ITER = 2


@dataclass(frozen=True)
class Peer:
    """One of torch's DDP communication hooks, as ``--peers`` names it.

    Args:
        kind: ``"powersgd"``, ``"fp16"`` or ``"bf16"``.
        rank: PowerSGD's matrix approximation rank (``None`` for fp16/bf16).

    Example:
        >>> Peer.parse("powersgd:1")
        Peer(kind='powersgd', rank=1)
        >>> Peer.parse("powersgd").name, Peer.parse("bf16").label
        ('powersgd:4', 'bf16 (torch hook)')
    """

    kind: str
    rank: int | None = None

    @staticmethod
    def parse(spec: str) -> Peer:
        """``"powersgd[:RANK]"``, ``"fp16"`` or ``"bf16"`` -> ``Peer``; anything else raises ``ValueError``."""
        kind, _, rank = spec.strip().lower().partition(":")
        if kind in ("fp16", "bf16") and not rank:
            return Peer(kind)
        if kind == "powersgd":
            if not rank:
                return Peer(kind, DEFAULT_POWERSGD_RANK)
            if rank.isdigit() and int(rank) >= 1:
                return Peer(kind, int(rank))
        raise ValueError(f"--peers {spec!r} is not allowed: expected {PEER_HELP} (RANK an integer >= 1)")

    @property
    def name(self) -> str:
        """The canonical ``--peers`` spelling (``powersgd:4``, ``fp16``)."""
        return f"{self.kind}:{self.rank}" if self.kind == "powersgd" else self.kind

    @property
    def label(self) -> str:
        """The row label of the benchmark's tables and plots."""
        if self.kind == "powersgd":
            return f"PowerSGD rank {self.rank} (torch hook)"
        return f"{self.kind} (torch hook)"

    def hook(self) -> tuple[Any, Callable[..., Any]]:
        """A fresh ``(state, hook)`` pair of torch's hook for ``DistributedDataParallel.register_comm_hook``."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.kind == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.rank,
                start_powerSGD_iter=POWERSGD_START_ITER,
                use_error_feedback=True,
                warm_start=True,
            )
            return state, powerSGD_hook.powerSGD_hook
        if self.kind == "fp16":
            return None, default_hooks.fp16_compress_hook
        if self.kind == "bf16":
            return None, default_hooks.bf16_compress_hook
        raise ValueError(f"kind={self.kind!r} is not allowed: expected powersgd, fp16 or bf16")

    def registered_hook(self) -> tuple[Any, Callable[..., Any]]:
        """The ``(state, hook)`` pair the benchmark registers: PowerSGD's wrapped in ``SequentialHook``
        (its collectives from future callbacks would interleave across buckets on gloo), the others as is."""
        state, hook = self.hook()
        if self.kind == "powersgd":
            return SequentialHook(state, hook), sequential_hook
        return state, hook


class SequentialHook:
    """A DDP comm hook state that runs ``hook`` on a bucket after the previous bucket's future completed.

    Register it with ``sequential_hook``: ``ddp.register_comm_hook(SequentialHook(state, hook), sequential_hook)``.

    Args:
        state: the wrapped hook's state.
        hook: the wrapped hook, ``hook(state, bucket) -> Future``.

    Example:
        >>> state, hook = Peer.parse("powersgd:1").hook()
        >>> sequential = SequentialHook(state, hook)
        >>> sequential.state is state
        True
    """

    def __init__(self, state: Any, hook: Callable[..., Any]) -> None:
        self.state = state
        self.hook = hook
        self.previous: torch.futures.Future | None = None


def sequential_hook(sequential: SequentialHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook of ``SequentialHook``: wait for the previous bucket's future, then run the wrapped hook."""
    if sequential.previous is not None:
        sequential.previous.wait()
    future = sequential.hook(sequential.state, bucket)
    # DDP waits for every bucket's future at the end of backward: the next step starts afresh
    sequential.previous = None if bucket.is_last() else future
    return future


# DDP's register_comm_hook checks these annotations against the objects (not the strings that
# ``from __future__ import annotations`` leaves)
sequential_hook.__annotations__["bucket"] = dist.GradBucket
sequential_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def local_gradient_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that keeps this rank's own gradient and sends nothing: for the peers
    that exchange in their optimizer (DeMo) or in a callback (torchft's DiLoCo) instead.

    Example:
        >>> strategy = CommHookDDPStrategy(ddp_comm_hook=local_gradient_hook)
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


local_gradient_hook.__annotations__["bucket"] = dist.GradBucket  # objects, as for sequential_hook
local_gradient_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


class CommHookDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that registers its communication hook on every device (Lightning's only does on CUDA).

    Args:
        ddp_comm_state: the hook's state (``None`` for the stateless default hooks: the process group is used).
        ddp_comm_hook: the hook, ``hook(state, bucket) -> Future``.
        **kwargs: passed to ``DDPStrategy``.

    Example:
        >>> state, hook = Peer.parse("fp16").hook()
        >>> strategy = CommHookDDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)
    """

    def __init__(self, ddp_comm_state: Any = None, ddp_comm_hook: Callable[..., Any] | None = None, **kwargs: Any):
        super().__init__(ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook, **kwargs)

    def _register_ddp_hooks(self) -> None:
        model = self.model
        if not isinstance(model, DistributedDataParallel):
            raise RuntimeError(f"expected the model wrapped in DistributedDataParallel, got {type(model).__name__}")
        if self._ddp_comm_hook is not None:
            model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


class CollectiveCounter:
    """Counts the bytes of the tensors handed to ``torch.distributed`` collectives, while switched on.

    ``install()`` wraps ``all_reduce``, ``all_gather``, ``all_gather_into_tensor`` and ``broadcast`` of
    ``torch.distributed`` (hooks look them up there when they run); ``counting()`` switches counting
    on for a block. PowerSGD issues collectives from future callbacks on other threads: the sum is
    kept under a lock, and counting is a flag, not a thread-local. ``uninstall()`` restores the
    originals.

    Example:
        >>> counter = CollectiveCounter()
        >>> counter.add([torch.zeros(10)])
        >>> counter.bytes
        0
        >>> with counter.counting():
        ...     counter.add([torch.zeros(10), torch.zeros(4, dtype=torch.float16)])
        >>> counter.bytes
        48
    """

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast")

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self._on = False
        self._lock = threading.Lock()
        self._originals: dict[str, Callable[..., Any]] = {}

    def add(self, tensors: list[Any]) -> None:
        """Count ``tensors`` (those given to one collective) if counting is on."""
        if not self._on:
            return
        n = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        with self._lock:
            self.bytes += n
            self.calls += 1

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count the collectives issued inside the block (and by callbacks that run meanwhile)."""
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def start(self) -> None:
        """Switch counting on (``stop()`` switches it off)."""
        self._on = True

    def stop(self) -> None:
        """Switch counting off."""
        self._on = False

    def install(self) -> None:
        """Wrap the collectives of ``torch.distributed`` (idempotent)."""
        if self._originals:
            return
        for name in self.NAMES:
            original = getattr(dist, name)
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))

    def uninstall(self) -> None:
        """Restore the collectives ``install()`` wrapped."""
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            # all_reduce(tensor), broadcast(tensor, src), all_gather(tensor_list, tensor),
            # all_gather_into_tensor(output, input): count what this rank contributes
            if name in ("all_reduce", "broadcast"):
                self.add([args[0] if args else kwargs.get("tensor")])
            else:
                self.add([args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))])
            return original(*args, **kwargs)

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted
