"""BatchNorm statistics for the global model, recomputed where one model is needed (update mode).

In update mode every process trains its own view of the model, the global model plus what it has
not sent yet, and BatchNorm's running statistics are gathered in the forward passes of that view.
When little of each step's progress reaches the global model (local steps, low densities) the view
and the global model drift apart, and the statistics fit the view, not the global parameters that
validation, checkpoints and the end of fit see. Measured on a ResNet-18-shaped CNN with BatchNorm
(SGD momentum, ``sync_every=4``): the global model validated at 0.19 with the statistics as
training left them and at 0.99 with statistics recomputed under its own parameters.

:class:`GlobalBatchNorm` keeps the inputs of the module's last training forward passes and, when
the strategy puts the global model in the module for such a use, recomputes every BatchNorm
layer's statistics under the global parameters from them (as ``torch.optim.swa_utils.update_bn``
does for an averaged model), then averages them over the processes so that every process holds
the same model. Training itself is untouched: BatchNorm normalises a training batch with that
batch's own statistics, and the random number generators are restored afterwards.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparse._utils import all_reduce_mean_
from lightning_sparse.stats import Counters, Telemetry
from lightning_sparse.wire import count_all_reduce

__all__ = ["GlobalBatchNorm"]


class GlobalBatchNorm:
    """Recomputes the BatchNorm statistics of a module's global model from its last training inputs.

    Args:
        batches: how many of the latest training forward passes' inputs are kept (references to
            the tensors the module was called with) and replayed; 0 turns it off.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        >>> norms = GlobalBatchNorm(batches=2)
        >>> norms.attach(net)
        True
        >>> _ = net(torch.randn(16, 4))          # a training forward: its input is kept
        >>> norms.recompute()                    # one process: nothing to average
        0
        >>> int(net[1].num_batches_tracked)
        1
    """

    def __init__(self, batches: int) -> None:
        self.batches = int(batches)
        self._module: nn.Module | None = None
        self._norms: list[nn.modules.batchnorm._BatchNorm] = []
        self._inputs: deque[tuple[tuple[Any, ...], dict[str, Any]]] = deque(maxlen=max(self.batches, 1))
        self._replaying = False
        #: training forward passes since the statistics were last recomputed
        self.stale = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_module=None, _norms=[], _inputs=deque(maxlen=max(self.batches, 1)))
        return state

    def attach(self, module: nn.Module) -> bool:
        """Keep the inputs of ``module``'s training forward passes, if it has BatchNorm layers that
        track running statistics and ``batches`` is not 0. Returns whether it attached."""
        norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        norms = [m for m in norms if m.track_running_stats]
        if self.batches == 0 or not norms:
            return False
        if self._module is not module:  # a second fit with the same module keeps its hook
            self._module, self._norms = module, norms
            module.register_forward_pre_hook(self._keep, with_kwargs=True)
        return True

    @property
    def attached(self) -> bool:
        """Whether a module with BatchNorm layers is attached."""
        return self._module is not None

    @property
    def kept(self) -> int:
        """How many training forward passes' inputs are kept now."""
        return len(self._inputs)

    def _keep(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        patched = module.__dict__.get("forward")
        if patched is not None and getattr(patched, "__func__", None) is not type(module).forward:
            # not a call of the model: Lightning routes training_step's arguments through DDP with
            # the module's forward patched on the instance; the real forward is called inside
            return
        if module.training and torch.is_grad_enabled() and not self._replaying:
            self._inputs.append((_detached(args), _detached(kwargs)))
            self.stale = True

    @torch.no_grad()
    def recompute(
        self, group: dist.ProcessGroup | None = None, world_size: int = 1, telemetry: Telemetry | None = None
    ) -> int:
        """Recompute every BatchNorm layer's running statistics under the parameters the module
        holds now (the global model), from the kept inputs, and average them over the ``world_size``
        processes of ``group`` (every process must call it at the same point; ``world_size`` 1: this
        process's own). Does nothing when no training forward ran since the last time. Returns the
        bytes handed to the all-reduce."""
        module = self._module
        if module is None or not self._inputs or not self.stale:
            return 0
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        modes = {m: m.training for m in module.modules()}
        momenta = {m: m.momentum for m in self._norms}
        self._replaying = True
        try:
            module.eval()  # dropout and the like stay off; only BatchNorm gathers statistics
            for m in self._norms:
                m.reset_running_stats()
                m.momentum = None  # a plain average over the replayed batches
                m.train()
            for args, kwargs in self._inputs:
                module(*args, **kwargs)
        finally:
            self._replaying = False
            for layer, mode in modes.items():
                layer.train(mode)
            for norm, momentum in momenta.items():
                norm.momentum = momentum
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        self.stale = False
        stats = [t for m in self._norms for t in (m.running_mean, m.running_var) if t is not None]
        nbytes = all_reduce_mean_(stats, group, world_size, torch.float32)
        if nbytes and telemetry is not None:
            counters = Counters()
            count_all_reduce(counters, world_size, nbytes)
            telemetry.record("BatchNorm statistics", counters, "BatchNorm statistics")
        return nbytes


def _detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value
