"""SparseConfig: every setting of the sparse exchange (type, default, validation, doc), declared once."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.optim import Optimizer

from lightning_sparse._utils import (
    bad_argument,
    check_bool,
    check_bucket_cap,
    check_choice,
    check_density,
    check_int,
    check_number,
    describe_callable,
    resolve_value_dtype,
)
from lightning_sparse.compressors import Compressor, compressors_of_pattern, get_compressor
from lightning_sparse.exchange.fallback import TimedFallback, as_fallback
from lightning_sparse.exchange.ft_env import check_fault_tolerance
from lightning_sparse.exchange.outer import OuterStep, resolve_outer_optimizer
from lightning_sparse.schedules import DensitySchedule, as_schedule
from lightning_sparse.wire import EXCHANGES
from lightning_sparse.wire.quant import VALUE_BITS

#: the places compression can happen
COMPRESS_MODES = ("update", "gradient")
#: the launchers DDP supports
START_METHODS = ("popen", "spawn", "fork", "forkserver")

_WHERE_DDP = "as in DDP, where one is built (update mode builds none but under ``fault_tolerant``)."


def _doc(text: str) -> Any:
    return {"doc": " ".join(text.split())}


@dataclass(frozen=True)
class SparseConfig:
    """The settings of the sparse exchange, validated (every bad value named in one ValueError) and normalised.

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
        metadata=_doc("""``"update"``: compress each rank's optimizer update, after its step; ``"gradient"``: the
            gradient, before the step, in DDP's communication hook."""),
    )
    compressor: str | Compressor = field(
        default="topk", metadata=_doc("a name from ``lightning_sparse.compressors.COMPRESSORS`` or a Compressor.")
    )
    density: float | DensitySchedule = field(
        default=0.01, metadata=_doc("fraction of each tensor sent per step, in (0, 1], or a density schedule.")
    )
    error_feedback: bool = field(default=True, metadata=_doc("keep what was not sent and send it later."))
    min_numel: int = field(default=1024, metadata=_doc("tensors with fewer elements (biases, norms) are sent dense."))
    warmup_steps: int = field(
        default=1, metadata=_doc("exchanges sent dense first (gradient mode: >= 1, DDP's bucket order; update: >= 0).")
    )
    value_dtype: Literal["float32", "float16", "bfloat16"] | torch.dtype | None = field(
        default=None,
        metadata=_doc('values sent as ``"float16"``, ``"bfloat16"`` or ``"float32"``; None: in the gradient dtype.'),
    )
    seed: int = field(default=0, metadata=_doc("seed of every random choice (shared coordinates, samples)."))
    fallback_to_dense: bool | Literal["bytes", "time"] | TimedFallback = field(
        default=True,
        metadata=_doc("""``True`` (or ``"bytes"``): send a bucket dense when sparse would move at least as many bytes as
            a dense all-reduce; ``"time"`` (or a ``TimedFallback``): that, then time a few dense and sparse steps after
            warm-up and go dense if dense was faster; ``False``: always sparse after warm-up."""),
    )
    momentum_correction: float = field(
        default=0.0,
        metadata=_doc("""DGC's momentum correction (gradient mode, e.g. 0.9), masked where sent; the optimizer must have
            none (``SGD(momentum=0)``, checked at setup). 0 (default): off."""),
    )
    exchange: Literal["auto", "allgather", "split"] = field(
        default="auto",
        metadata=_doc("""how compressors of pattern ``"gather"`` combine picks: ``"allgather"``, ``"split"`` (Ok-Topk's
            sparse all-reduce) or ``"auto"``: per bucket, the split where it moves <= 1/4 the all-gather's bytes."""),
    )
    compact_indices: bool = field(
        default=True,
        metadata=_doc("send indices as an exact Rice code of their gaps wherever that is smaller; ``False``: int32."),
    )
    sync_every: int = field(
        default=1,
        metadata=_doc("""update mode: each rank takes this many optimizer steps on its own, then exchanges its progress
            since the last exchange plus its residual (local SGD, DiLoCo's ``H``); 1 (default): every step."""),
    )
    outer_optimizer: Literal["nesterov"] | Callable[[Iterable[Any]], Optimizer] | OuterStep | None = field(
        default=None,
        metadata=_doc("""update mode: what the global parameters do with each exchange's average: None (default): add it
            (:class:`~lightning_sparse.exchange.outer.AddAverage`); ``"nesterov"``: DiLoCo's outer step (SGD, lr 0.7,
            momentum 0.9, Nesterov); an optimizer class or factory; or an
            :class:`~lightning_sparse.exchange.outer.OuterStep`."""),
    )
    outer_momentum: float | None = field(
        default=None,
        metadata=_doc("""update mode, with ``outer_optimizer="nesterov"``: the outer step's momentum, in (0, 1);
            None (default): DiLoCo's 0.9."""),
    )
    value_bits: Literal[2, 4, 8] | None = field(
        default=None,
        metadata=_doc("""values of a sparse exchange as 2-, 4- or 8-bit codes, a bfloat16 scale per 64 (2 bits:
            ternary), the error kept in the residual; None (default): ``value_dtype``. Pattern ``"gather"`` only."""),
    )
    error_feedback_decay: float = field(
        default=1.0,
        metadata=_doc("""update mode: at each exchange the residual is multiplied by this factor in (0, 1] before
            the progress joins it (SparseLoCo's decayed error feedback); 1 keeps ``sent + e_new == e_old + delta``."""),
    )
    batchnorm_batches: int = field(
        default=16,
        metadata=_doc("""update mode: wherever the module gets the global model, its BatchNorm statistics are recomputed
            under the global parameters from this many latest training inputs, averaged over the processes. 0: off."""),
    )
    batchnorm_warmup: int = field(
        default=40,
        metadata=_doc("""update mode, a BatchNorm model sending under 1 % of each step's progress (constant ``density``
            / ``sync_every`` < 0.01): its density falls from 0.1 to ``density`` over this many steps; 0: off."""),
    )
    flush_at_end: bool | int = field(
        default=True,
        metadata=_doc("""update mode: at the end of a Trainer fit (Fabric: ``strategy.end_fit()``), add the mean of
            every process's residual to the global model exactly (one dense float32 all-reduce); an int R >= 1: R more
            exchanges as configured instead; False: the global model as the last exchange left it."""),
    )
    max_nonfinite_steps: int = field(
        default=8,
        metadata=_doc("""update mode: a non-finite update of a parameter is dropped (parameter back to global, optimizer
            state reset, a warning); this many consecutive steps with one stop the fit. 0: never."""),
    )
    sync_delay: int = field(
        default=0,
        metadata=_doc("""update mode with ``sync_every > 1``: apply each exchange's average this many optimizer steps
            after launching it (at most ``sync_every``; Streaming DiLoCo's overlap). 0 (default): wait for it."""),
    )
    fragments: int = field(
        default=1,
        metadata=_doc("""update mode with ``sync_every > 1``: this many fragments of about equal size, each exchanged
            once per cycle at its own step (Streaming DiLoCo); 1 (default): the whole model at once."""),
    )
    fragment_split: Literal["strided", "contiguous"] = field(
        default="strided",
        metadata=_doc("""how ``fragments`` are made: ``"strided"`` (default): each tensor, in module order, joins the
            smallest fragment so far; ``"contiguous"``: runs of consecutive tensors, cut at equal shares."""),
    )
    offload_global: bool = field(
        default=False,
        metadata=_doc("""update mode: keep the global parameters (and an outer optimizer's state) in CPU memory, pinned
            where CUDA is; an exchange stages one bucket at a time on the device."""),
    )
    offload_residual: bool = field(
        default=False, metadata=_doc("update mode: keep the residual in CPU memory (staged on the device by bucket).")
    )
    fault_tolerant: bool = field(
        default=False,
        metadata=_doc("""update mode: this job is one replica group of several that meet on torchft at each exchange
            (``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``); a group that dies does not stop the
            others and heals when back. Under ``sparse_fsdp``: ``shard_size`` None."""),
    )
    min_replicas: int = field(
        default=1, metadata=_doc("``fault_tolerant``: the fewest replica groups an exchange runs with; fewer wait.")
    )
    quorum_timeout: float = field(
        default=60.0, metadata=_doc("``fault_tolerant``: seconds a quorum, a collective or a recovery may take.")
    )
    find_unused_parameters: bool = field(default=False, metadata=_doc(_WHERE_DDP))
    static_graph: bool = field(default=False, metadata=_doc(_WHERE_DDP))
    gradient_as_bucket_view: bool | None = field(
        default=None,
        metadata=_doc("""as in DDP, where one is built; ``None`` (default): ``True`` with ``compress="update"``,
            ``False`` with ``compress="gradient"`` (DDP's default)."""),
    )
    bucket_cap_mb: float | None = field(
        default=None,
        metadata=_doc("""as in DDP (None: DDP's default, 25); in update mode also the exchange's buckets (None: 1024,
            one bucket for up to 256M float32 parameters; 25 when offloading)."""),
    )
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = field(
        default="popen",
        metadata=_doc('the launcher\'s start method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.'),
    )
    #: ``outer_optimizer`` resolved: a factory of optimizers or an outer step (None: add the average)
    outer_factory: Callable[[Iterable[Any]], Optimizer] | OuterStep | None = field(
        init=False, repr=False, compare=False
    )
    #: ``fallback_to_dense`` resolved: the byte rule on or off, and the timed fallback (None: off)
    byte_rule: bool = field(init=False, repr=False, compare=False)
    timed_fallback: TimedFallback | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # each argument on its own first, every wrong one named in one error; then the rules between arguments
        errors: list[ValueError] = []

        def each(check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            try:
                return check(*args, **kwargs)
            except ValueError as error:
                errors.append(error)
                return None

        for name in ("find_unused_parameters", "static_graph", "compact_indices", "error_feedback"):
            each(check_bool, name, getattr(self, name))
        view = "expected None (True with compress='update', False with compress='gradient'), True or False"
        each(check_choice, "gradient_as_bucket_view", self.gradient_as_bucket_view, (None, True, False), view)
        each(check_bucket_cap, self.bucket_cap_mb)
        each(check_choice, "start_method", self.start_method, START_METHODS, f"expected one of {list(START_METHODS)}")
        modes = (
            "expected 'update' (compress each rank's optimizer update, after its step) or 'gradient' (compress the "
            "gradient, before the step)"
        )
        each(check_choice, "compress", self.compress, COMPRESS_MODES, modes)
        compressor = each(get_compressor, self.compressor)
        choices = f"expected one of {list(EXCHANGES)} ('auto': per bucket, the split where it moves at most a quarter "
        each(check_choice, "exchange", self.exchange, EXCHANGES, choices + "of the all-gather's bytes)")
        schedule = each(as_schedule, self.density)
        each(check_int, "min_numel", self.min_numel, minimum=0)
        each(check_int, "warmup_steps", self.warmup_steps, minimum=0 if self.compress == "update" else 1)
        value_dtype = each(resolve_value_dtype, self.value_dtype)
        each(check_int, "seed", self.seed, minimum=0)
        byte_rule, timed = each(as_fallback, self.fallback_to_dense) or (True, None)
        each(check_density, "error_feedback_decay", self.error_feedback_decay)
        in_range = "expected a number in [0, 1) (0 turns it off)"
        momentum = each(check_number, "momentum_correction", self.momentum_correction, in_range, lambda v: 0 <= v < 1)
        for name in ("sync_every", "fragments"):
            each(check_int, name, getattr(self, name), minimum=1)
        for name in ("batchnorm_batches", "batchnorm_warmup", "sync_delay", "max_nonfinite_steps"):
            each(check_int, name, getattr(self, name), minimum=0)
        for name in ("offload_global", "offload_residual"):
            each(check_bool, name, getattr(self, name))
        flush = self.flush_at_end
        if not isinstance(flush, int) or (not isinstance(flush, bool) and flush < 1):
            errors.append(bad_argument("flush_at_end", flush, "expected True, False or an int >= 1 (exchanges)"))
        splits = ("strided", "contiguous")
        each(check_choice, "fragment_split", self.fragment_split, splits, "expected 'strided' or 'contiguous'")
        outer = each(resolve_outer_optimizer, self.outer_optimizer, self.outer_momentum)
        each(check_choice, "value_bits", self.value_bits, (None, *VALUE_BITS), "expected None, 2, 4 or 8")
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ValueError(f"{len(errors)} arguments are not allowed:\n" + "\n".join(f"- {e}" for e in errors))
        self._check_together(compressor, timed, outer)
        normalised = dict(compressor=compressor, density=schedule, value_dtype=value_dtype, outer_factory=outer)
        normalised.update(momentum_correction=momentum, byte_rule=byte_rule, timed_fallback=timed)
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    def _check_together(self, compressor: Compressor, timed: TimedFallback | None, outer: Any) -> None:
        """The rules between arguments, each valid on its own (ValueError at the first broken one)."""
        m, update, gather = self.momentum_correction, self.compress == "update", compressor.pattern == "gather"
        picking = f"(pattern 'gather': {', '.join(compressors_of_pattern('gather'))})"
        local = f"compress={self.compress!r} and sync_every={self.sync_every}"
        first = (
            (self.exchange == "split" and not gather,
             f"exchange='split' is not allowed with compressor={compressor!r}: it combines compressors that pick "
             f"their own coordinates on each rank {picking}; this one's pattern is {compressor.pattern!r}. Use "
             "exchange='auto' or 'allgather'."),
            (m and update,
             f"momentum_correction={m!r} is not allowed with compress='update': each rank's optimizer keeps its own "
             "momentum there and only its update is compressed; use momentum_correction=0, or compress='gradient' "
             "for DGC's momentum correction."),
            (self.sync_delay and (not update or self.sync_delay > self.sync_every or self.sync_every == 1),
             f"sync_delay={self.sync_delay} is not allowed with {local}: expected 0, or with compress='update' and "
             "sync_every > 1 at most sync_every (an exchange is applied before the same fragment's next one)."),
            (self.error_feedback_decay != 1 and (not update or self.sync_delay or not self.error_feedback),
             f"error_feedback_decay={self.error_feedback_decay!r} is not allowed with {local}, sync_delay="
             f"{self.sync_delay} and error_feedback={self.error_feedback}: the decay applies to update mode's "
             "residuals at an exchange applied at once; use compress='update' with sync_delay=0, or 1 (no decay)."),
            (self.fragments == 1 and self.fragment_split != "strided",
             f"fragment_split={self.fragment_split!r} is not allowed with fragments=1: there is nothing to split; "
             "set fragments > 1, or leave fragment_split at 'strided'."),
            (self.fragments > 1 and (not update or self.sync_every == 1),
             f"fragments={self.fragments} is not allowed with {local}: fragments stagger the exchanges of a cycle "
             "of local steps; use compress='update' with sync_every > 1, or fragments=1."),
            (self.offload_global and not update,
             "offload_global=True is not allowed with compress='gradient': only update mode keeps a global copy; "
             "use compress='update', or offload_global=False."),
            (self.offload_residual and not update,
             "offload_residual=True is not allowed with compress='gradient': the hook's residuals stay with the "
             "gradients; use compress='update', or offload_residual=False."),
            (not update and self.sync_every != 1,
             f"sync_every={self.sync_every!r} is not allowed with compress='gradient': gradients are exchanged at "
             "every optimizer step there; use compress='update' for local steps, or sync_every=1."),
            (self.fault_tolerant is True and not isinstance(self.flush_at_end, bool),
             f"flush_at_end={self.flush_at_end!r} is not allowed with fault_tolerant=True: the hand-over in exchanges "
             "needs the same processes throughout; expected True (exact, where a quorum forms) or False."),
        )  # fmt: skip
        then = (
            (outer is not None and not update,
             f"outer_optimizer={self.outer_optimizer!r} is not allowed with compress='gradient': the average of the "
             "exchanged gradients goes to the optimizer itself there; use compress='update'."),
            (self.value_bits is not None and not gather,
             f"value_bits={self.value_bits!r} is not allowed with compressor={compressor!r}: coded values are "
             f"all-gathered with their coordinates, for compressors that pick their own {picking}; this one's "
             f"pattern is {compressor.pattern!r}."),
            (self.value_bits is not None and self.value_dtype is not None,
             f"value_bits={self.value_bits!r} is not allowed with value_dtype={self.value_dtype!r}: the codes "
             "replace the value dtype; set one of them."),
        )  # fmt: skip
        for rules in (first, then):
            for broken, message in rules:
                if broken:
                    raise ValueError(message)
            if rules is first:
                check_fault_tolerance(
                    self.fault_tolerant, self.min_replicas, self.quorum_timeout, self.compress, timed is not None
                )

    @property
    def schedule(self) -> DensitySchedule:
        """The density schedule (``density`` normalised)."""
        return typing.cast(DensitySchedule, self.density)

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``DistributedDataParallel`` these settings fix."""
        view = self.gradient_as_bucket_view
        return {
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.compress == "update" if view is None else view,
            **({} if self.bucket_cap_mb is None else {"bucket_cap_mb": self.bucket_cap_mb}),
        }

    def fingerprint(self) -> dict[str, Any]:
        """The settings that must agree on every rank (compared when the hook is bound)."""
        compressor = typing.cast(Compressor, self.compressor)
        described = {"compressor", "density", "value_dtype", "fallback_to_dense", "outer_optimizer"}
        return {
            **{name: getattr(self, name) for name in setting_names() if name not in _PER_RANK | described},
            "compressor": type(compressor).__name__,
            "compressor_config": compressor.config(),
            "schedule": repr(self.schedule),
            "value_dtype": str(self.value_dtype),
            "fallback_to_dense": self.byte_rule,
            "timed_fallback": repr(self.timed_fallback),
            "outer_optimizer": describe_callable(self.outer_optimizer),
        }


#: the settings that need not agree on every rank (left out of :meth:`SparseConfig.fingerprint`)
_PER_RANK = {
    "min_replicas", "quorum_timeout", "find_unused_parameters", "static_graph", "gradient_as_bucket_view",
    "bucket_cap_mb", "start_method",
}  # fmt: skip


def setting_names() -> tuple[str, ...]:
    """The names of the settings, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(SparseConfig) if f.init)


def setting_docs() -> dict[str, str]:
    """Each setting's documentation (the argument docs of both strategies)."""
    return {f.name: f.metadata["doc"] for f in dataclasses.fields(SparseConfig) if f.init}
