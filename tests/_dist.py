"""Run test functions on real gloo process groups: a pool of worker processes kept for the session.

Starting a process and importing Lightning costs seconds, so the workers are started once and
reused; a test that fails or hangs (a collective that never completes) restarts them.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from lightning_sparse._utils import TORCH_FOR_FSDP2, TORCH_FOR_FSDP2_FT, TORCH_FOR_FT, free_port, torch_at_least

#: what the torch at hand runs (the strategies refuse the rest at construction)
FSDP2 = torch_at_least(TORCH_FOR_FSDP2)
needs_fsdp2 = pytest.mark.skipif(not FSDP2, reason=f"sparse_fsdp needs torch >= {TORCH_FOR_FSDP2}")
FSDP2_FT = torch_at_least(TORCH_FOR_FSDP2_FT)
#: torchft is installed and this torch runs it
FT = importlib.util.find_spec("torchft") is not None and torch_at_least(TORCH_FOR_FT)


def skip_without_ft() -> None:
    """Skip (a test, or a module where called at import) without torchft or with a torch it cannot run on."""
    pytest.importorskip("torchft")
    if not torch_at_least(TORCH_FOR_FT):
        pytest.skip(f"fault_tolerant=True needs torch >= {TORCH_FOR_FT}", allow_module_level=True)


try:  # FSDP2's collectives can be wrapped, so the bytes moved inside a group are counted (torch 2.9 and newer)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather  # noqa: F401

    GROUP_BYTES = True
except ImportError:
    GROUP_BYTES = False


def _worker(rank: int, world_size: int, port: int, inbox: Any, outbox: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, kwargs = job
        try:
            outbox.put((rank, True, fn(rank, world_size, **kwargs)))
        except BaseException:  # report everything, including assertion failures
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` processes joined in one gloo process group, running submitted functions."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self._inboxes[r], self._outbox), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def stop(self) -> None:
        for inbox in getattr(self, "_inboxes", []):
            try:
                inbox.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def run(self, fn: Callable[..., Any], timeout: float = 180, **kwargs: Any) -> list[Any]:
        """Call ``fn(rank, world_size, **kwargs)`` on every rank; return the results by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.stop()
            self._start()
        for inbox in self._inboxes:
            inbox.put((fn, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            for _ in range(self.world_size):
                rank, ok, value = self._outbox.get(timeout=timeout)
                (results if ok else errors)[rank] = value
        except queue.Empty:
            self.stop()
            msg = f"{fn.__name__} did not finish on all ranks within {timeout}s (hung collective?)"
            raise TimeoutError(msg) from None
        if errors:
            self.stop()  # a failed rank may have left the group out of step
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed:\n{detail}")
        return [results[r] for r in range(self.world_size)]
