"""SparseConfig: every setting of the sparse exchange, declared once.

Each setting's type, default, validation and documentation live here; the Trainer and Fabric
strategies keep flat, typed keyword arguments (the Lightning CLI reads their signatures) and a test
checks that their signatures, defaults and argument docs match this class. The state of the hook
(:class:`~lightning_sparse.state.SparseState`) is built from a config; what must agree on every
rank is :meth:`SparseConfig.fingerprint`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lightning_sparse._utils import check_bool, check_int, resolve_value_dtype
from lightning_sparse.compressors import Compressor, get_compressor
from lightning_sparse.fallback import TimedFallback, as_fallback
from lightning_sparse.schedules import DensitySchedule, as_schedule
from lightning_sparse.wire import EXCHANGES

#: the places compression can happen
COMPRESS_MODES = ("update", "gradient")
#: the launchers DDP supports
START_METHODS = ("popen", "spawn", "fork", "forkserver")


def _doc(text: str) -> Any:
    return {"doc": " ".join(text.split())}


@dataclass(frozen=True)
class SparseConfig:
    """The settings of the sparse exchange, validated at construction.

    ``compressor``, ``density`` and ``value_dtype`` are normalised (a Compressor, a
    :class:`~lightning_sparse.schedules.DensitySchedule`, a torch dtype or None); a bad value raises
    ValueError naming the argument, the value and what is allowed. The field docs are the argument
    docs of both strategies.

    Example:
        >>> config = SparseConfig(compressor="randomk", density=0.001)
        >>> config.compressor.name, config.density.density(step=0), config.compress
        ('randomk', 0.001, 'update')
        >>> SparseConfig(density=2.0)
        Traceback (most recent call last):
        ...
        ValueError: density=2.0 is not allowed: expected a number in (0, 1].
    """

    compress: Literal["update", "gradient"] = field(
        default="update",
        metadata=_doc(
            """``"update"``: compress each rank's optimizer update (trains close to dense with AdamW
            and with SGD + momentum; the exchange runs after the optimizer step); ``"gradient"``:
            compress the gradient before the step, in DDP's communication hook (overlaps with
            backward; suits plain SGD)."""
        ),
    )
    compressor: str | Compressor = field(
        default="topk",
        metadata=_doc("a name from ``lightning_sparse.compressors.COMPRESSORS`` or a Compressor."),
    )
    density: float | DensitySchedule = field(
        default=0.01, metadata=_doc("fraction of each tensor sent per step, in (0, 1], or a density schedule.")
    )
    error_feedback: bool = field(default=True, metadata=_doc("keep what was not sent and send it later."))
    min_numel: int = field(default=1024, metadata=_doc("tensors with fewer elements (biases, norms) are sent dense."))
    warmup_steps: int = field(
        default=1,
        metadata=_doc("the first optimizer steps sent dense (>= 1: DDP learns its bucket order in the first step)."),
    )
    value_dtype: Literal["float32", "float16", "bfloat16"] | torch.dtype | None = field(
        default=None,
        metadata=_doc(
            """dtype of the values sent (``"float16"``, ``"bfloat16"``, ``"float32"``); None sends the
            gradient's dtype. Rounding errors go into the residual."""
        ),
    )
    seed: int = field(default=0, metadata=_doc("seed of every random choice (shared coordinates, samples)."))
    fallback_to_dense: bool | Literal["bytes", "time"] | TimedFallback = field(
        default=True,
        metadata=_doc(
            """``True`` (or ``"bytes"``): send a bucket dense when the sparse exchange would move at
            least as many bytes as a dense all-reduce (all-gather traffic grows with world size).
            ``"time"`` (or a ``TimedFallback``): that, and after warm-up time a few dense and sparse
            steps on this link and send everything dense if dense was faster (fast links, where the
            hook's own passes cost more than the bytes they save). ``False``: always sparse after
            warm-up."""
        ),
    )
    momentum_correction: float = field(
        default=0.0,
        metadata=_doc(
            """DGC's momentum correction (e.g. 0.9; gradient mode): the hook keeps each rank's
            momentum ``u <- m*u + g``, runs error feedback on it and zeroes what was sent in ``u``
            too (momentum factor masking), so coordinates that wait long do not hit an optimizer
            momentum all at once. Use it with an optimizer without momentum (``SGD(momentum=0)``;
            checked at setup). 0 (default) turns it off."""
        ),
    )
    exchange: Literal["auto", "allgather", "split"] = field(
        default="auto",
        metadata=_doc(
            """how top-k-type selections (topk, rtopk, gaussiank, dgc) are combined:
            ``"allgather"`` (every rank gets every rank's pairs; traffic per rank grows with the
            number of ranks), ``"split"`` (a sparse all-reduce after Ok-Topk: traffic per rank about
            flat in the number of ranks; the global selection keeps about ``k`` coordinates per
            bucket tensor), ``"auto"`` (default): per bucket, the split where it moves at most a
            quarter of the all-gather's bytes (from about 16 ranks), else the all-gather."""
        ),
    )
    compact_indices: bool = field(
        default=True,
        metadata=_doc(
            """send indices in an exact Rice code of their gaps (about 1.1 bytes each at density
            0.01 instead of 4) wherever that is smaller; ``False``: int32."""
        ),
    )
    find_unused_parameters: bool = field(default=False, metadata=_doc("as in DDP."))
    static_graph: bool = field(default=False, metadata=_doc("as in DDP."))
    gradient_as_bucket_view: bool | None = field(
        default=None,
        metadata=_doc(
            """as in DDP; ``None`` (default): ``True`` with ``compress="update"`` (DDP's buckets carry
            nothing there, so gradients living in them saves two copies of every gradient per
            step), ``False`` with ``compress="gradient"`` (DDP's default)."""
        ),
    )
    bucket_cap_mb: float | None = field(default=None, metadata=_doc("as in DDP (None: DDP's default, 25)."))
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = field(
        default="popen",
        metadata=_doc('the launcher\'s start method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.'),
    )
    #: ``fallback_to_dense`` resolved: the byte rule on or off, and the timed fallback (None: off)
    byte_rule: bool = field(init=False, repr=False, compare=False)
    timed_fallback: TimedFallback | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_bool("find_unused_parameters", self.find_unused_parameters)
        check_bool("static_graph", self.static_graph)
        if self.gradient_as_bucket_view not in (None, True, False):
            raise ValueError(
                f"gradient_as_bucket_view={self.gradient_as_bucket_view!r} is not allowed: expected None (True with "
                "compress='update', False with compress='gradient'), True or False."
            )
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"bucket_cap_mb={cap!r} is not allowed: expected None or a number > 0.")
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method={self.start_method!r} is not allowed: expected 'popen', 'spawn', 'fork' or 'forkserver'."
            )
        if self.compress not in COMPRESS_MODES:
            raise ValueError(
                f"compress={self.compress!r} is not allowed: expected 'update' (compress each rank's optimizer "
                "update, after its step) or 'gradient' (compress the gradient, before the step)."
            )
        compressor = get_compressor(self.compressor)
        if self.exchange not in EXCHANGES:
            raise ValueError(
                f"exchange={self.exchange!r} is not allowed: expected one of {list(EXCHANGES)} ('allgather': every "
                "rank gets every rank's selection; 'split': a sparse all-reduce whose traffic does not grow with the "
                "number of ranks; 'auto': per bucket, the split where it moves at most a quarter of the "
                "all-gather's bytes)."
            )
        if self.exchange == "split" and compressor.pattern != "gather":
            raise ValueError(
                f"exchange='split' is not allowed with compressor={compressor!r}: it combines compressors "
                "that pick their own coordinates on each rank (pattern 'gather': topk, rtopk, gaussiank, dgc); "
                f"this one's pattern is {compressor.pattern!r}. Use exchange='auto' or 'allgather'."
            )
        check_bool("compact_indices", self.compact_indices)
        schedule = as_schedule(self.density)
        check_bool("error_feedback", self.error_feedback)
        check_int("min_numel", self.min_numel, minimum=0)
        check_int("warmup_steps", self.warmup_steps, minimum=1)
        value_dtype = resolve_value_dtype(self.value_dtype)
        check_int("seed", self.seed, minimum=0)
        byte_rule, timed = as_fallback(self.fallback_to_dense)
        m = self.momentum_correction
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
            raise ValueError(f"momentum_correction={m!r} is not allowed: expected a number in [0, 1) (0 turns it off).")
        if m and self.compress == "update":
            raise ValueError(
                f"momentum_correction={m!r} is not allowed with compress='update': each rank's optimizer keeps its "
                "own momentum there and only its update is compressed; use momentum_correction=0, or "
                "compress='gradient' for DGC's momentum correction."
            )
        for name, value in (
            ("compressor", compressor),
            ("density", schedule),
            ("value_dtype", value_dtype),
            ("momentum_correction", float(m)),
            ("byte_rule", byte_rule),
            ("timed_fallback", timed),
        ):
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ derived
    @property
    def schedule(self) -> DensitySchedule:
        """The density schedule (``density`` normalised)."""
        return typing.cast(DensitySchedule, self.density)

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``DistributedDataParallel`` these settings fix."""
        view = self.gradient_as_bucket_view
        kwargs: dict[str, Any] = {
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.compress == "update" if view is None else view,
        }
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        return kwargs

    def fingerprint(self) -> dict[str, Any]:
        """The settings that must agree on every rank (compared when the hook is bound)."""
        compressor = typing.cast(Compressor, self.compressor)
        return {
            "compressor": type(compressor).__name__,
            "compressor_config": compressor.config(),
            "schedule": repr(self.schedule),
            "error_feedback": self.error_feedback,
            "min_numel": self.min_numel,
            "warmup_steps": self.warmup_steps,
            "value_dtype": str(self.value_dtype),
            "seed": self.seed,
            "fallback_to_dense": self.byte_rule,
            "timed_fallback": repr(self.timed_fallback),
            "momentum_correction": self.momentum_correction,
            "compress": self.compress,
            "exchange": self.exchange,
            "compact_indices": self.compact_indices,
        }

    @classmethod
    def of(cls, arguments: dict[str, Any]) -> SparseConfig:
        """The config of the settings among ``arguments`` (a shell's ``locals()``)."""
        return cls(**{name: arguments[name] for name in setting_names() if name in arguments})


def setting_names() -> tuple[str, ...]:
    """The names of the settings, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(SparseConfig) if f.init)


def setting_docs() -> dict[str, str]:
    """Each setting's documentation (the argument docs of both strategies)."""
    return {f.name: f.metadata["doc"] for f in dataclasses.fields(SparseConfig) if f.init}
