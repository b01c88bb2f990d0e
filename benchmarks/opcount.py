"""Counting what a block of code asks of torch: operators, host reads and collectives.

:class:`OpCounter` is a ``TorchDispatchMode``: inside ``with OpCounter() as ops:`` every ATen
operator dispatched on this thread is counted (on CPU tensors as on CUDA ones, so a CPU test sees
the operator count a GPU would launch kernels for). Among them it singles out those that make the
host wait for the device:

- operators that read a tensor's value on the host: ``aten::_local_scalar_dense`` (what
  ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)`` and ``aten::is_nonzero`` come down to),
  ``aten::equal`` and ``aten::allclose`` (they return a Python bool);
- operators whose output size depends on the values, so the host must learn it before it can
  allocate the output: ``nonzero`` (``torch.where(mask)``, ``argwhere``), ``masked_select``,
  ``unique`` and ``unique_consecutive``, ``repeat_interleave`` without ``output_size``,
  ``bincount``, ``histc``, and indexing or index-assignment with a boolean mask (``x[mask]``,
  ``x[mask] = v``, which call ``nonzero`` inside the kernel, out of the dispatcher's sight);
- copies from a device to the CPU (``aten::_to_copy`` / ``aten::copy_``; on CPU-only runs there
  are none), and ``Tensor.tolist()`` / ``Tensor.numpy()``, which read a CPU tensor without any
  operator at all (they are counted by wrapping the two methods while the block runs);
- tensors made from host data (``torch.tensor([...], device=...)``, ``t[i] = 1``:
  ``aten::lift_fresh``): on a GPU the copy from pageable host memory can make the host wait.

These are the operators ``torch.cuda.set_sync_debug_mode`` reports on a GPU, and those the
profiler shows as ``cudaStreamSynchronize``; ``torch.nonzero_static`` and ``torch.topk`` (sizes
fixed in advance) are not among them.

Collectives are counted twice over, and both are kept: the ``c10d`` operators the dispatcher sees
(``c10d::allreduce_``, ``c10d::_allgather_base_``, ``c10d::alltoall_base_``, ... on gloo and NCCL
alike, on the counting thread), and, with ``comm=True``, the calls of the package's raw
collectives, ``lightning_sparse.wire.comm.all_reduce`` / ``all_gather`` / ``all_to_all``, which it
looks up at every call (counted from any thread while the block runs).

The dispatch mode is per thread: operators run by future callbacks on a backend's threads are not
seen; drive the code so that the work happens on the counting thread (wait, then use the result).

Example:
    >>> import torch
    >>> x = torch.arange(6.0)
    >>> with OpCounter() as ops:
    ...     y = (x * 2).sum()
    ...     flag = bool(y > 3)
    ...     kept = x[x > 2]
    >>> ops.total, ops.host_read_count, dict(ops.host_reads)
    (6, 2, {'aten::_local_scalar_dense': 1, 'aten::index (boolean mask)': 1})
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READING_OPS", "OpCounter", "count_comm_calls"]

#: ATen operators (by overload packet, ``namespace::name``) that read values on the host
HOST_READING_OPS: frozenset[str] = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::is_nonzero",
        "aten::equal",
        "aten::allclose",
        "aten::nonzero",
        "aten::argwhere",
        "aten::masked_select",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        "aten::bincount",
        "aten::histc",
    }
)
#: operators that read host-side only when a boolean (or uint8) mask is among their indices
_MASK_INDEXING = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
#: copies: a host read when they bring a device tensor to the CPU
_COPIES = frozenset({"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"})
#: the package's raw collectives (module functions of ``lightning_sparse.wire.comm``)
COMM_FUNCTIONS = ("all_reduce", "all_gather", "all_to_all")


def _packet(func: Any) -> str:
    """``aten::add`` for ``aten.add.Tensor``."""
    name = func.name()  # "aten::add.Tensor"
    return name.split(".", 1)[0]


def _has_mask(indices: Any) -> bool:
    items = indices if isinstance(indices, (list, tuple)) else [indices]
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in items if t is not None)


def _device_to_host(packet: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a copy brings a non-CPU tensor to the CPU."""
    if packet == "aten::copy_":
        dst, src = args[0], args[1]
        return src.device.type != "cpu" and dst.device.type == "cpu"
    if packet == "aten::_to_copy":
        src = args[0]
        device = kwargs.get("device")
        return src.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"
    src = args[0]
    dst = args[1] if len(args) > 1 else None
    return isinstance(dst, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"


class OpCounter(TorchDispatchMode):
    """Counts operators, host reads and collectives within a ``with`` block (see the module's text).

    Args:
        comm: also count the calls of ``lightning_sparse.wire.comm``'s raw collectives (the module
            functions are wrapped while the block runs and restored after it).

    Attributes:
        ops: operator (``namespace::name``) -> times dispatched.
        host_reads: host-reading operator -> times (a boolean-mask indexing and a device-to-host
            copy are named as such; ``Tensor.tolist`` / ``Tensor.numpy`` as ``tolist`` / ``numpy``).
        collectives: ``c10d`` operator -> times dispatched on this thread.
        comm_calls: ``lightning_sparse.wire.comm`` function -> calls (with ``comm=True``).
    """

    def __init__(self, comm: bool = True) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.collectives: Counter[str] = Counter()
        self.comm_calls: Counter[str] = Counter()
        self._comm = comm
        self._lock = threading.Lock()
        self._restore: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ totals
    @property
    def total(self) -> int:
        """Operators dispatched (collectives included)."""
        return sum(self.ops.values())

    @property
    def host_read_count(self) -> int:
        """Host reads: each one makes the host wait for every kernel queued before it on a GPU."""
        return sum(self.host_reads.values())

    @property
    def collective_count(self) -> int:
        """Collectives issued: the larger of the package's raw collective calls and the ``c10d``
        operators seen on this thread (each sees some the other may not)."""
        return max(sum(self.collectives.values()), sum(self.comm_calls.values()))

    def summary(self) -> dict[str, Any]:
        """The totals and the host reads and collectives by name (for printing and JSON)."""
        return {
            "ops": self.total,
            "host_reads": self.host_read_count,
            "collectives": self.collective_count,
            "host_reads_by_op": dict(self.host_reads),
            "c10d_ops": dict(self.collectives),
            "comm_calls": dict(self.comm_calls),
        }

    def top(self, n: int = 10) -> list[tuple[str, int]]:
        """The ``n`` most frequent operators."""
        return self.ops.most_common(n)

    # ------------------------------------------------------------------ the mode
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        packet = _packet(func)
        self.ops[packet] += 1
        if packet.startswith("c10d::"):
            self.collectives[packet] += 1
        elif packet in HOST_READING_OPS:
            self.host_reads[packet] += 1
        elif packet in _MASK_INDEXING:
            if _has_mask(args[1] if len(args) > 1 else kwargs.get("indices")):
                self.host_reads[f"{packet} (boolean mask)"] += 1
        elif packet == "aten::repeat_interleave":
            if kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor) and len(args) < 4:
                self.host_reads[f"{packet} (no output_size)"] += 1
        elif packet in _COPIES and _device_to_host(packet, args, kwargs):
            self.host_reads[f"{packet} (device to host)"] += 1
        elif packet == "aten::lift_fresh":
            self.host_reads["torch.tensor (host data)"] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> OpCounter:
        self._patch_tensor_methods()
        if self._comm:
            counting = count_comm_calls(self.comm_calls)  # adds to the counts of earlier blocks
            counting.__enter__()
            self._restore.append(lambda: counting.__exit__(None, None, None))
        super().__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            while self._restore:
                self._restore.pop()()

    # ------------------------------------------------------------------ what the dispatcher does not see
    def _patch_tensor_methods(self) -> None:
        counter = self

        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)

            def wrapped(tensor: torch.Tensor, *args: Any, _name: str = name, _orig: Any = original, **kw: Any) -> Any:
                with counter._lock:
                    counter.host_reads[_name] += 1
                return _orig(tensor, *args, **kw)

            setattr(torch.Tensor, name, wrapped)
            self._restore.append(lambda _n=name, _o=original: setattr(torch.Tensor, _n, _o))


@contextmanager
def count_comm_calls(into: Counter[str] | None = None) -> Iterator[Counter[str]]:
    """Count the calls of ``lightning_sparse.wire.comm``'s raw collectives within the block, from
    any thread, without a dispatch mode (cheap enough for timed runs); ``into``: a counter to add
    them to (default: a new one).

    Example:
        >>> with count_comm_calls() as calls:
        ...     pass
        >>> sum(calls.values())
        0
    """
    from lightning_sparse.wire import comm

    calls: Counter[str] = Counter() if into is None else into
    lock = threading.Lock()
    originals = {name: getattr(comm, name) for name in COMM_FUNCTIONS}

    def make(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with lock:
                calls[name] += 1
            return original(*args, **kwargs)

        return wrapped

    for name, original in originals.items():
        setattr(comm, name, make(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(comm, name, original)
