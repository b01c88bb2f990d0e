"""Small helpers shared by the package: argument checks, seeding, scratch buffers, process-group ends."""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import random
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

_MASK64 = (1 << 64) - 1


def bad_argument(name: str, value: Any, allowed: str) -> ValueError:
    """The package's error for a rejected argument, describing a tensor by dtype, shape and device (not its values)."""
    if isinstance(value, torch.Tensor):
        shown = f"<{value.dtype} tensor of shape {tuple(value.shape)} on {value.device}>"
    else:
        shown = repr(value)
    return ValueError(f"{name}={shown} is not allowed: {allowed}.")


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) within the bounds, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_argument(name, value, "expected an integer")
    if minimum is not None and value < minimum:
        raise bad_argument(name, value, f"expected an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise bad_argument(name, value, f"expected an integer <= {maximum}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``, else ValueError naming ``name``."""
    if not isinstance(value, bool):
        raise bad_argument(name, value, "expected True or False")
    return value


def check_number(name: str, value: object, allowed: str, accept: Callable[[float], bool]) -> float:
    """``value`` as a float if it is a finite number (not a bool) that ``accept`` takes, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not accept(value):
        raise bad_argument(name, value, allowed)
    return float(value)


def check_density(name: str, value: Any) -> float:
    """Return ``value`` as a float if it lies in (0, 1], else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_argument(name, value, "expected a number in (0, 1]")
    if not 0.0 < value <= 1.0:
        raise bad_argument(name, float(value), "expected a number in (0, 1]")
    return float(value)


def stable_key(name: str) -> int:
    """A 32-bit key for a parameter name that is the same in every process (unlike ``hash``)."""
    return zlib.crc32(name.encode("utf-8"))


def mix_seed(*parts: int) -> int:
    """Combine integers into one 63-bit seed (splitmix64 finaliser), identical on every rank."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (int(part) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A dedicated generator on ``device`` (never the global RNG), seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_value_dtype(value: Any) -> torch.dtype | None:
    """Map ``value_dtype`` (None, a name or a torch dtype) to a torch dtype, else raise ValueError."""
    if value is None or (isinstance(value, torch.dtype) and value in _DTYPES.values()):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise bad_argument("value_dtype", value, f"expected None or one of {sorted(_DTYPES)}")


# reused scratch buffers, keyed by thread too: DDP's hook and the process group's callbacks run on different threads
_SCRATCH: dict[tuple[Any, ...], torch.Tensor] = {}


def scratch(tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D buffer of ``numel`` elements, reused across calls with the same tag (contents undefined)."""
    key = (tag, dtype, device, threading.get_ident())
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _SCRATCH[key] = buf
    return buf[:numel]


class RegionViews:
    """Views of a flat tensor at fixed ``(offset, numel)`` regions (``shapes``: their shapes), made once per tensor.

    Example:
        >>> views = RegionViews(((0, 2), (2, 3)))
        >>> flat = torch.arange(5.0)
        >>> [v.tolist() for v in views.of(flat)], views.of(flat) is views.of(flat)
        ([[0.0, 1.0], [2.0, 3.0, 4.0]], True)
    """

    def __init__(self, regions: tuple[tuple[int, int], ...], shapes: tuple[torch.Size, ...] | None = None) -> None:
        self.regions = regions
        self.shapes = shapes
        self._key: tuple[int, int, int, torch.dtype, torch.device] | None = None
        self._views: list[torch.Tensor] = []

    def of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The views of ``flat``: the same list while it is the same memory of the same storage (addresses recur)."""
        key = (flat.untyped_storage()._cdata, flat.data_ptr(), flat.numel(), flat.dtype, flat.device)
        if key != self._key:
            views = [flat[a : a + n] for a, n in self.regions]
            if self.shapes is not None:
                views = [v.view(shape) for v, shape in zip(views, self.shapes, strict=True)]
            self._views = views
            self._key = key
        return self._views


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of ``t`` is finite: its float32 sum, confirmed element-wise where that overflows."""
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


@torch.no_grad()
def all_reduce_mean_(tensors: list[torch.Tensor], group: Any, world_size: int, dtype: torch.dtype) -> int:
    """Replace each of ``tensors`` by its mean over the ``world_size`` processes of ``group`` (one all-reduce,
    flattened in ``dtype``, in their order: the same on every process). Returns the bytes all-reduced.

    Example:
        >>> t = torch.ones(3)
        >>> all_reduce_mean_([t], None, 1, torch.float64), t  # one process: nothing to average
        (0, tensor([1., 1., 1.]))
    """
    if world_size <= 1 or not tensors:
        return 0
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat.div_(world_size)
    pos = 0
    for t in tensors:
        t.copy_(flat[pos : pos + t.numel()].view_as(t))
        pos += t.numel()
    return flat.numel() * flat.element_size()


def check_same_everywhere(settings: dict[str, Any], group: Any, world_size: int) -> None:
    """Raise ValueError, naming each difference, unless every process of ``group`` has the same ``settings``."""
    mine = json.dumps(settings, sort_keys=True, default=str)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    if any(g != gathered[0] for g in gathered):
        first, *others = map(json.loads, gathered)
        diffs = [
            f"{k}: rank 0 has {v!r}, rank {rank} has {other.get(k)!r}"
            for rank, other in enumerate(others, 1)
            for k, v in first.items()
            if other.get(k) != v
        ]
        raise ValueError(
            "SparseDDPStrategy is configured differently across ranks; every rank must use the same "
            "settings or the collectives would hang or mix mismatched data. Differences: " + "; ".join(diffs)
        )


#: the oldest torch each part runs on (docs/getting-started.md, "Versions"): FSDP2 on CPUs, torchft 0.2's process
#: groups, and a healing ``sparse_fsdp`` group's streaming load of shards that may be empty
TORCH_FOR_FSDP2, TORCH_FOR_FT, TORCH_FOR_FSDP2_FT = "2.7", "2.8", "2.10"


def torch_at_least(version: str) -> bool:
    """Whether the torch at hand is ``version`` or newer (read at each call).

    >>> torch_at_least("2.0")
    True
    """
    return torch.torch_version.TorchVersion(torch.__version__) >= version


def end_process_group(exit_code: int | None = None) -> None:
    """End the default process group on every rank together (a barrier, then destroy), if one exists, before
    interpreter shutdown can abort a gloo thread (docs/guarantees.md, "Exit code"); with ``exit_code``, then flush
    stdout and stderr and leave at once (``os._exit``: call it last)."""
    if dist.is_available() and dist.is_initialized():
        _barrier_and_settle()
        dist.destroy_process_group()
    if exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


#: after the barrier, how long the main thread sleeps (the interpreter lock released) for gloo's worker threads
#: to drop the last collectives they ran: a work completes a moment before its thread releases it
_SETTLE_SECONDS = 0.05


def _barrier_and_settle() -> None:
    """A barrier of every rank (every collective issued before it completes), then a pause in which the worker
    threads that ran them free what they held while the interpreter is whole."""
    dist.barrier()
    time.sleep(_SETTLE_SECONDS)


class _ExitPlan:
    """What the exit handler of :func:`end_process_group_at_exit` acts on."""

    registered = False
    group: Any = None  # the default process group a strategy ran on
    created = False  # a strategy's setup created that group
    failed = False  # the last run's teardown saw an exception on its way out


_EXIT = _ExitPlan()


def end_process_group_at_exit(created: bool) -> None:
    """Have the default process group ended at interpreter exit, as :func:`end_process_group` does (destroyed only
    if ``created`` by the strategy's setup); nothing where the group was replaced or the process leaves on an error."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = dist.group.WORLD
    _EXIT.created = created or (_EXIT.created and group is _EXIT.group)  # the same group: created by any run
    _EXIT.group = group
    if not _EXIT.registered:
        atexit.register(_end_at_exit)
        _EXIT.registered = True


def note_run_end(failed: bool) -> None:
    """Record whether the run being torn down ended with an exception (then the exit handler leaves the group)."""
    _EXIT.failed = failed


def _end_at_exit() -> None:
    leaving_on_error = getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
    if _EXIT.failed or leaving_on_error:
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.group.WORLD is not _EXIT.group:
        return
    try:
        _barrier_and_settle()
        if _EXIT.created:
            dist.destroy_process_group()
    except Exception:  # a rank is gone or failed: there is nothing to end together
        return
    finally:
        _EXIT.group = None


#: the ports :func:`free_port` picks from start here, below the kernel's ephemeral ones
_FIXED_PORTS = 20000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket holds right now, e.g. for ``MASTER_PORT``.

    Picked at random below the kernel's ephemeral ports where there are any: one the kernel gives (bind to 0)
    may go to another process's outgoing connection before the process group's store binds it.
    """
    try:  # the lowest port the kernel gives outgoing connections
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    pick = random.SystemRandom()  # not the seeded global generator: two processes seeded alike pick alike
    for _ in range(64 if low - _FIXED_PORTS > 1000 else 0):
        port = pick.randrange(_FIXED_PORTS, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_choice(name: str, value: Any, allowed: Iterable[Any], text: str) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``allowed`` (``text``: what is allowed)."""
    if not any(value is a or (not isinstance(value, bool) and value == a) for a in allowed):
        raise bad_argument(name, value, text)


def check_bucket_cap(cap: Any) -> None:
    """ValueError unless ``bucket_cap_mb`` is None or a number > 0."""
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise bad_argument("bucket_cap_mb", cap, "expected None or a number > 0")


def describe_callable(value: Any) -> Any:
    """A description of a setting's value that is the same in every process (no addresses).

    Example:
        >>> describe_callable(functools.partial(torch.optim.SGD, lr=0.7))
        'torch.optim.sgd.SGD(lr=0.7)'
    """
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, functools.partial):
        args = [repr(a) for a in value.args] + [f"{k}={v!r}" for k, v in sorted(value.keywords.items())]
        return f"{describe_callable(value.func)}({', '.join(args)})"
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"{getattr(value, '__module__', None) or type(value).__module__}.{name}"
