"""The compressor interface (which coordinates of ``p``, gradient plus residual, are sent) and the name registry."""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from lightning_sparse._utils import make_generator, mix_seed

#: ``"gather"`` (each rank's ``k`` values and indices all-gathered), ``"shared"`` (the same coordinates on every
#: rank: values all-reduced) or ``"sketch"`` (sketches all-reduced, then the values at the candidates)
Pattern = str

#: name -> compressor class; a compressor joins with ``@register_compressor``.
COMPRESSORS: dict[str, type[Compressor]] = {}
#: answers :meth:`Compressor.ks_for` keeps before it starts again (a warm-up's density changes every step)
_KS_MEMO_SIZE = 1024


def k_for(numel: int, density: float) -> int:
    """Coordinates sent of a tensor of ``numel`` elements at ``density``: ``round(density * numel)`` in ``[1, numel]``.

    Example:
        >>> k_for(1000, 0.01), k_for(10, 0.01), k_for(10, 1.0)
        (10, 1, 10)
    """
    return max(1, min(numel, round(density * numel)))


@dataclass(frozen=True)
class CompressContext:
    """What a compressor may know about the tensor it compresses: the optimizer ``step`` (synchronised steps only) and
    a stable 32-bit ``key`` of the parameter name, both the same on every rank; this process's ``rank``, the
    ``world_size`` exchanging and the strategy's ``seed``.

    Example:
        >>> import torch
        >>> ctx = CompressContext(step=3, key=7, rank=0, world_size=2, seed=0)
        >>> other = CompressContext(step=3, key=7, rank=1, world_size=2, seed=0)
        >>> a = torch.randint(0, 100, (4,), generator=ctx.shared_generator(torch.device("cpu")))
        >>> torch.equal(a, torch.randint(0, 100, (4,), generator=other.shared_generator(torch.device("cpu"))))
        True
    """

    step: int = 0
    key: int = 0
    rank: int = 0
    world_size: int = 1
    seed: int = 0

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """A generator seeded from (seed, step, key): the same stream on every rank."""
        return make_generator(device, mix_seed(self.seed, 0x5EED, self.step, self.key))

    def local_generator(self, device: torch.device) -> torch.Generator:
        """A generator seeded from (seed, rank, step, key): different on each rank, reproducible."""
        return make_generator(device, mix_seed(self.seed, 0x10CA1, self.rank, self.step, self.key))


class Compressor(ABC):
    """Base class of all compressors: subclasses implement :meth:`select` and set ``pattern``. Every random choice
    comes from the :class:`CompressContext`'s generators: a compressor is stateless and resumes exactly.

    Example:
        >>> import torch
        >>> from lightning_sparse.compressors import TopK, CompressContext
        >>> TopK().select(torch.tensor([0.1, -3.0, 2.0, 0.5]), 2, CompressContext()).sort().values
        tensor([1, 2])
    """

    name: ClassVar[str] = ""
    pattern: ClassVar[Pattern] = "gather"
    #: the wire's bucket-at-once rule that picks exactly what :meth:`select` picks, or None: one tensor at a time
    at_once: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "select" in cls.__dict__ and "at_once" not in cls.__dict__:
            cls.at_once = None  # a rule written for the parent's choice is not this class's choice

    def selects_at_once(self, rule: str) -> bool:
        """Whether the wire's bucket-at-once ``rule`` picks exactly what :meth:`select` picks."""
        return self.at_once == rule

    @abstractmethod
    def select(self, p: Tensor, k: int, ctx: CompressContext) -> Tensor:
        """Return the int64 indices of the coordinates of the 1-D tensor ``p`` to send: ``"gather"``: exactly ``k``
        unique indices; ``"shared"``: the same on every rank (from ``ctx.shared_generator`` and the sizes only)."""

    def k_for(self, numel: int, density: float) -> int:
        """How many of ``numel`` coordinates it sends at ``density`` (from sizes and settings: alike on every rank)."""
        return k_for(numel, density)

    def ks_for(self, numels: tuple[int, ...], density: float) -> list[int]:
        """:meth:`k_for` of each of ``numels`` (a bucket's sparse tensors), kept per float ``density``."""
        if type(density) is not float:  # a schedule's own number type: as it is, each time
            return [self.k_for(n, density) for n in numels]
        memo: dict[tuple[tuple[int, ...], float], tuple[int, ...]] = self.__dict__.setdefault("_ks_memo", {})
        ks = memo.get((numels, density))
        if ks is None:
            if len(memo) >= _KS_MEMO_SIZE:
                memo.clear()
            ks = memo[(numels, density)] = tuple(self.k_for(n, density) for n in numels)
        return list(ks)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_ks_memo", None)  # kept answers, not settings
        return state

    def config(self) -> dict[str, Any]:
        """The constructor arguments, for checkpoints, logs and cross-rank consistency checks."""
        return {n: getattr(self, n) for n in _init_args(type(self)) if hasattr(self, n)}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compressor) and type(self) is type(other) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.config().items()))))


@functools.cache
def _init_args(cls: type[Compressor]) -> tuple[str, ...]:
    """The names of ``cls``'s constructor arguments (read once per class: the wire hashes compressors per step)."""
    return tuple(inspect.signature(cls).parameters)


class ChunkedCompressor(Protocol):
    """What a compressor choosing rows of ``chunk`` values declares (``at_once = "chunk"``): the wire lays a
    bucket's tensors out as rows and picks every row's share in one ``torch.topk``.

    Example:
        >>> from lightning_sparse.compressors import ChunkTopK
        >>> chunked: ChunkedCompressor = ChunkTopK(chunk=4)
        >>> chunked.row_picks(10, 5)  # rows of 4, 4 and 2 values
        (2, 2, 1)
    """

    chunk: int

    def __hash__(self) -> int:
        """Settings only: the wire keeps its layouts per compressor."""

    def row_picks(self, numel: int, k: int) -> tuple[int, ...]:
        """How many of each row's values :meth:`Compressor.select` sends of ``k`` (the last row holds the rest)."""


class SketchCompressor(Protocol):
    """What a compressor of the ``"sketch"`` pattern declares: the wire sizes its tables and candidates,
    sketches and picks through these, one tensor at a time or (``at_once = "countsketch"``) a bucket at once.

    Example:
        >>> from lightning_sparse.compressors import CountSketch
        >>> sketching: SketchCompressor = CountSketch(rows=3)
        >>> sketching.table_shape(1000, 10), sketching.num_candidates(1000, 10)
        ((3, 100), 40)
    """

    rows: int

    def __hash__(self) -> int:
        """Settings only: the wire keeps its layouts per compressor."""

    def table_shape(self, numel: int, k: int) -> tuple[int, int]:
        """``(rows, cols)`` of the table of a tensor of ``numel`` elements sending ``k``."""

    def num_candidates(self, numel: int, k: int) -> int:
        """How many candidates the second round sums."""

    def truncation(self, device: torch.device) -> float:
        """The local pre-truncation in effect on ``device`` (0: none)."""

    def sketch(self, p: Tensor, k: int, ctx: CompressContext, table: Tensor) -> None:
        """Add this rank's ``p`` into ``table`` (``rows x cols``, float32)."""

    def candidates(self, table: Tensor, numel: int, k: int, ctx: CompressContext) -> Tensor:
        """The candidates in the summed ``table``: the same on every rank."""

    def pick(self, sums: Tensor, k: int) -> Tensor:
        """Positions of the ``k`` candidates applied, from their summed values."""


def register_compressor(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make ``cls`` selectable by its ``name`` (``compressor="name"``)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute `name` to be registered.")
    existing = COMPRESSORS.get(cls.name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"compressor name {cls.name!r} is already taken by {existing.__qualname__}.")
    COMPRESSORS[cls.name] = cls
    return cls


def compressors_of_pattern(pattern: str) -> list[str]:
    """The registered compressors' names whose ``pattern`` is ``pattern``, sorted.

    Example:
        >>> compressors_of_pattern("shared")
        ['randomblock', 'randomk']
    """
    return sorted(name for name, cls in COMPRESSORS.items() if cls.pattern == pattern)


def get_compressor(spec: str | Compressor) -> Compressor:
    """Resolve a compressor name or instance; unknown names raise ValueError listing the known ones."""
    if isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str) and spec.lower() in COMPRESSORS:
        return COMPRESSORS[spec.lower()]()
    raise ValueError(
        f"compressor={spec!r} is not allowed: expected a Compressor instance or one of {sorted(COMPRESSORS)}."
    )
