"""BatchNorm statistics for the global model (update mode), recomputed from replayed training inputs."""

from __future__ import annotations

import sys
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from lightning_sparse._utils import all_reduce_mean_
from lightning_sparse.wire import count_all_reduce
from lightning_sparse.wire.stats import Counters, Telemetry

__all__ = ["GlobalBatchNorm"]

Path = tuple[Any, ...]


@dataclass(frozen=True)
class _Link:
    """In a recorded input: the output of the pass's ``entry``-th call, at ``path`` inside it."""

    entry: int
    path: Path


@dataclass
class _Entry:
    """One recorded call: the module, its inputs (detached, or links), and weak references to its outputs."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[tuple[Path, weakref.ref[Tensor], int]] = field(default_factory=list)


#: a frame of the call stack: Lightning's redirected call, or a call nested in a recorded one
_REDIRECTED, _NESTED = "redirected", "nested"


class GlobalBatchNorm:
    """Recomputes the BatchNorm statistics of a module's global model from its last training inputs.

    It records the outermost calls of the modules holding BatchNorm layers in the last training forwards (an input
    an earlier call returned becomes a link to it), replays them under the global parameters, as
    ``torch.optim.swa_utils.update_bn`` does, and averages the statistics over the processes. Layers no recorded
    call reaches keep training's, averaged.

    Args:
        batches: how many of the latest training forward passes are kept and replayed; 0 turns it off.

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
        self._norms: dict[_BatchNorm, str] = {}  # the layers, and their names
        self._handles: list[RemovableHandle] = []
        self._passes: deque[list[_Entry]] = deque(maxlen=max(self.batches, 1))
        self._stack: list[tuple[nn.Module, _Entry | str]] = []
        self._active = 0  # frames that are calls of the model
        self._replaying = False
        self._ended = False  # a redirected call (training_step) ended: so did the pass
        self._reached: set[_BatchNorm] = set()
        self._fallback_step: int | None = None
        #: training forward passes recorded since the statistics were last recomputed
        self.stale = False
        self._replayed_at = -1  # the parameters' version counters (summed) at the last replay
        #: names of the BatchNorm layers the last call could not recompute (averaged as training left them)
        self.fallback: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(
            _module=None, _norms={}, _handles=[], _stack=[], _active=0, _reached=set(),
            _passes=deque(maxlen=max(self.batches, 1)),
        )  # fmt: skip
        return state

    def attach(self, module: nn.Module, step: int = 0) -> bool:
        """Watch the calls of ``module`` and of its submodules holding a BatchNorm layer; whether it attached.
        ``step``: the optimizer step the processes are at."""
        named = [(n, m) for n, m in module.named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
        if self.batches == 0 or not named:
            return False
        if self._module is module:
            return True
        for handle in self._handles:
            handle.remove()
        self._module, self._norms = module, {m: n for n, m in named}
        self._passes.clear()
        self._stack, self._active, self._ended, self._reached = [], 0, False, set()
        self._fallback_step = step
        # the root, every ancestor of a BatchNorm layer, and the layers themselves
        prefixes = {".".join(n.split(".")[:i]) for n, _ in named for i in range(n.count(".") + 2)}
        self._handles = []
        for name, sub in module.named_modules():
            if name in prefixes:
                self._handles.append(sub.register_forward_pre_hook(self._enter, with_kwargs=True))
                self._handles.append(sub.register_forward_hook(self._leave, always_call=True))
        return True

    @property
    def attached(self) -> bool:
        """Whether a module with BatchNorm layers is attached."""
        return self._module is not None

    @property
    def passes(self) -> list[list[_Entry]]:
        """The kept passes, oldest first: each the recorded calls of one training forward, in order."""
        return list(self._passes)

    @property
    def links(self) -> int:
        """How many recorded inputs are links to an earlier call's output (in the kept passes)."""
        return sum(isinstance(v, _Link) for p in self._passes for e in p for _, v in _leaves((e.args, e.kwargs)))

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        patched = module.__dict__.get("forward")
        if patched is not None and getattr(patched, "__func__", None) is not type(module).forward:
            # Lightning's training_step, routed through a forward patched on the instance: the real calls come inside
            self._stack.append((module, _REDIRECTED))
            return
        self._active += 1
        if self._active > 1 or not (module.training and torch.is_grad_enabled()) or self._replaying:
            self._stack.append((module, _NESTED))  # the replay of the outermost call runs it
            return
        current = self._passes[-1] if self._passes else None
        if current is None or self._ended or any(e.module is module for e in current):
            current = []  # a module entered again, or a new training_step: the next pass
            self._passes.append(current)
            self._ended = False
        entry = _Entry(module, *_record(current, args, kwargs))
        current.append(entry)
        self._stack.append((module, entry))
        self.stale = True

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._stack or self._stack[-1][0] is not module:
            return  # a pre-hook ahead of ours raised: this call was never entered
        _, frame = self._stack.pop()
        if frame is _REDIRECTED:
            self._ended = True
            return
        self._active -= 1
        if not isinstance(frame, _Entry):
            return
        if output is None and sys.exc_info()[0] is not None:  # the call raised: nothing to replay
            current = self._passes[-1]
            current.remove(frame)
            if not current:
                self._passes.pop()
            return
        frame.outputs = [(path, weakref.ref(t), t._version) for path, t in _leaves(output)]

    @torch.no_grad()
    def recompute(
        self,
        group: dist.ProcessGroup | None = None,
        world_size: int = 1,
        telemetry: Telemetry | None = None,
        step: int | None = None,
    ) -> int:
        """Recompute the statistics under the parameters the module holds and average them over ``group``
        (every process at the same point); returns the bytes handed to the all-reduce."""
        module = self._module
        if module is None or self._replaying:
            return 0
        # replayed after new training passes, or where the parameters moved since the last replay (the
        # end-of-fit hand-over, a healing group's state): statistics belong to the parameters they were taken under
        version = sum(p._version for p in module.parameters())
        replay = (self.stale or version != self._replayed_at) and bool(self._passes)
        unreached = [m for m in self._norms if m not in self._reached]
        moved = step is not None and step != self._fallback_step and bool(unreached)
        if not (replay or moved):
            return 0
        if replay:
            self._replay(module)
            self.stale, self._replayed_at = False, version
            unreached = [m for m in self._norms if m not in self._reached]
        self.fallback = [self._norms[m] for m, n in zip(unreached, _tracked(unreached), strict=True) if n > 0]
        if world_size > 1 and step is not None:
            self._fallback_step = step
        stats = [t for m in self._norms for t in (m.running_mean, m.running_var) if t is not None]
        nbytes = all_reduce_mean_(stats, group, world_size, torch.float32)
        if nbytes and telemetry is not None:
            counters = Counters()
            count_all_reduce(counters, world_size, nbytes)
            telemetry.record("BatchNorm statistics", counters, "BatchNorm statistics")
        return nbytes

    def _replay(self, module: nn.Module) -> None:
        """Reset the layers under the kept calls and run the kept passes again; a layer not run gets its own back."""
        targets = {id(e.module): e.module for p in self._passes for e in p}.values()
        below = {id(m) for t in targets for m in t.modules()}
        under = [m for m in self._norms if id(m) in below]
        saved = {m: [None if t is None else t.clone() for t in _stats(m)] for m in under}
        modes = {m: m.training for m in module.modules()}
        momenta = {m: m.momentum for m in self._norms}
        self._replaying = True
        with torch.random.fork_rng(range(torch.cuda.device_count()), device_type="cuda"):
            try:
                module.eval()  # dropout and the like stay off; only BatchNorm gathers statistics
                for m in under:
                    m.reset_running_stats()
                    m.momentum = None  # a plain average over the replayed batches
                    m.train()
                for entries in self._passes:
                    outputs: list[Any] = []
                    for e in entries:
                        args, kwargs = _resolve((e.args, e.kwargs), outputs)
                        outputs.append(e.module(*args, **kwargs))
            finally:
                self._replaying = False
                for layer, mode in modes.items():
                    layer.train(mode)
                for norm, momentum in momenta.items():
                    norm.momentum = momentum
        self._reached = set()
        for m, count in zip(under, _tracked(under), strict=True):
            if count > 0:
                self._reached.add(m)
            else:  # under a kept call's module, but not run by it: its statistics back
                for t, s in zip(_stats(m), saved[m], strict=True):
                    if t is not None and s is not None:
                        t.copy_(s)


def _tracked(norms: list[_BatchNorm]) -> list[int]:
    """Each layer's ``num_batches_tracked`` (one read from the device)."""
    counts = [m.num_batches_tracked for m in norms if m.num_batches_tracked is not None]
    return torch.stack(counts).tolist() if len(counts) == len(norms) and counts else [1] * len(norms)


def _stats(m: _BatchNorm) -> tuple[Tensor | None, ...]:
    return m.running_mean, m.running_var, m.num_batches_tracked


def _map(value: Any, fn: Callable[[Any, Path], Any], path: Path = ()) -> Any:
    """``value`` with ``fn(leaf, path)`` in place of every tensor and link."""
    if isinstance(value, (Tensor, _Link)):
        return fn(value, path)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map(v, fn, (*path, i)) for i, v in enumerate(value)))
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn, (*path, i)) for i, v in enumerate(value))
    if isinstance(value, dict):
        return {k: _map(v, fn, (*path, k)) for k, v in value.items()}
    return value


def _leaves(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every tensor and link in ``value`` (tuples, lists, dicts, ``ModelOutput``) with its path, as :func:`_map`."""
    if isinstance(value, (Tensor, _Link)):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))


def _record(entries: list[_Entry], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` as kept: a tensor an earlier call returned becomes a link, others are detached."""
    returned: dict[int, tuple[Tensor, _Link]] = {}
    for i, e in enumerate(entries):
        for path, ref, version in e.outputs:
            t = ref()
            # alive, so its id is its own; changed in place since: not what the call returned
            if t is not None and t._version == version:
                returned[id(t)] = (t, _Link(i, path))

    def keep(t: Any, _: Path) -> Any:
        found = returned.get(id(t))
        return found[1] if found is not None and found[0] is t else t.detach()

    return _map(args, keep), _map(kwargs, keep)


def _resolve(value: Any, outputs: list[Any]) -> Any:
    """A kept input with every link replaced by the replayed output it points to."""

    def fetch(leaf: Any, _: Path) -> Any:
        if not isinstance(leaf, _Link):
            return leaf
        out = outputs[leaf.entry]
        for key in leaf.path:
            out = out[key]
        return out

    return _map(value, fetch)
