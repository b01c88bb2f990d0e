"""DiLoCo as torchft ships it (``torchft.local_sgd.DiLoCo``), a reference row of ``bench convergence``
and ``bench parties``.

Every Lightning rank is one torchft replica group of size 1: DDP's hook keeps each rank's gradient
(:func:`~benchmarks.peers.local_gradient_hook`), the rank's own optimizer is DiLoCo's inner
optimizer, and every ``H`` of its steps torchft all-reduces the pseudo-gradients (global minus local
parameters, float32) through its own gloo process group and steps the outer optimizer (SGD, lr 0.7,
momentum 0.9, Nesterov). Rank 0 runs torchft's lighthouse on the loopback; each rank a store and a
``Manager`` (synchronous quorum, as DiLoCo requires). Validation sees the global parameters, as for
this library's rows: the parameters right after the last outer step are swapped in for it.

Bytes: the tensors handed to torchft's process group (counted as they are handed over); the quorum's
small gRPC messages to the lighthouse are not counted. Needs the optional package:
``pip install -e ".[bench]"``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import lightning as L
import torch

from benchmarks.peers import CollectiveCounter

#: DiLoCo's outer step (Douillard et al., 2023)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
#: seconds torchft may wait on a quorum or a collective (its default is 60)
TIMEOUT_S = 300


class DiLoCoPeer:
    """torchft's ``DiLoCo`` around one process's module and inner optimizer, in any training loop:
    every process is one replica group of size 1; process 0 runs the lighthouse.

    Call :meth:`start` once the module is wrapped (DDP has broadcast process 0's weights), then
    :meth:`after_step` after each inner optimizer step (inside it, every ``sync_every`` steps,
    torchft all-reduces the pseudo-gradients and steps the outer optimizer), and :meth:`close` at
    the end. :attr:`global_params` are the parameters right after the last outer step.

    Example:
        >>> peer = DiLoCoPeer(sync_every=16)
        >>> peer.sync_every, peer.counter.bytes, peer.global_params
        (16, 0, [])
    """

    def __init__(self, sync_every: int, counter: CollectiveCounter | None = None) -> None:
        self.sync_every = int(sync_every)
        self.counter = CollectiveCounter() if counter is None else counter
        self.global_params: list[torch.Tensor] = []
        self._lighthouse: Any = None
        self._store: Any = None
        self._manager: Any = None
        self._diloco: Any = None
        self._outer_steps = 0

    def start(
        self, rank: int, world_size: int, broadcast: Any, module: torch.nn.Module, inner: torch.optim.Optimizer
    ) -> None:
        """Start the lighthouse (process 0), this process's ``Manager`` and ``DiLoCo``; ``broadcast(obj,
        src=0)`` hands process 0's lighthouse address to all (the front end's broadcast)."""
        from torch.distributed import TCPStore
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager

        os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum otherwise
        address = None
        if rank == 0:
            self._lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=world_size)
            address = "http://127.0.0.1:" + self._lighthouse.address().rsplit(":", 1)[1]
        address = broadcast(address, src=0)
        # the launcher's MASTER_ADDR/RANK/WORLD_SIZE describe its own group: the replica group of
        # size 1 gets its own store, passed explicitly so that torchft does not read them
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=TIMEOUT_S)
        self._manager = Manager(
            pg=_counting_gloo(self.counter, timeout),
            load_state_dict=module.load_state_dict,
            state_dict=module.state_dict,
            min_replica_size=world_size,
            use_async_quorum=False,
            init_sync=False,  # DDP broadcast process 0's weights when it wrapped the model
            replica_id=f"rank{rank}",
            store_addr="127.0.0.1",
            store_port=self._store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=address,
            hostname="127.0.0.1",
            port=0,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        outer = torch.optim.SGD(module.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        # DiLoCo keeps its copy of the global parameters from here: after DDP's broadcast
        self._diloco = DiLoCo(self._manager, [module], inner, outer, sync_every=self.sync_every).__enter__()
        self.global_params = [p.detach().clone() for p in module.parameters()]

    def after_step(self, module: torch.nn.Module) -> None:
        """After an inner optimizer step: right after an outer step the module holds the global
        parameters, kept as :attr:`global_params`."""
        steps = self._manager.current_step()  # outer steps committed
        if steps != self._outer_steps:
            self._outer_steps = steps
            _copy(self.global_params, module.parameters())

    def close(self) -> None:
        """Leave DiLoCo and shut torchft's servers down (safe to call twice)."""
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)
            self._diloco = None
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None


class TorchftDiLoCo(L.Callback):
    """Runs torchft's ``DiLoCo`` around the fit's optimizer (use with a DDP strategy whose hook keeps
    each rank's gradient: ``CommHookDDPStrategy(ddp_comm_hook=local_gradient_hook)``); validation
    sees the parameters of the last outer step.

    Args:
        sync_every: inner steps between outer steps (``H``).
        counter: counts the tensors torchft's process group all-reduces (while switched on).

    Example:
        >>> callback = TorchftDiLoCo(sync_every=16)
        >>> callback.sync_every, callback.counter.bytes
        (16, 0)
    """

    def __init__(self, sync_every: int, counter: CollectiveCounter | None = None) -> None:
        self.peer = DiLoCoPeer(sync_every, counter)
        self._local: list[torch.Tensor] = []  # this rank's, while validation holds the global ones

    @property
    def sync_every(self) -> int:
        return self.peer.sync_every

    @property
    def counter(self) -> CollectiveCounter:
        return self.peer.counter

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        self.peer.start(trainer.global_rank, trainer.world_size, strategy.broadcast, pl_module, trainer.optimizers[0])

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.peer.after_step(pl_module)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peer._diloco is None:
            return
        self._local = [p.detach().clone() for p in pl_module.parameters()]
        _copy(pl_module.parameters(), self.peer.global_params)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._local:
            return
        _copy(pl_module.parameters(), self._local)
        self._local = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peer.close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.peer.close()


@torch.no_grad()
def _copy(targets: Iterable[torch.Tensor], sources: Iterable[torch.Tensor]) -> None:
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def _counting_gloo(counter: CollectiveCounter, timeout: timedelta) -> Any:
    """torchft's reconfigurable gloo process group, counting what it is handed to all-reduce."""
    from torchft.process_group import ProcessGroupGloo

    class CountingGloo(ProcessGroupGloo):
        def allreduce(self, tensors: Any, opts: Any) -> Any:
            counter.add(list(tensors) if isinstance(tensors, list | tuple) else [tensors])
            return super().allreduce(tensors, opts)

    return CountingGloo(timeout=timeout)
