"""One optimizer step of the exchange on one rank (:class:`StepExchange`): how each bucket is sent, and its average.

Compression is per parameter (``k = round(density * numel)``, at least 1): results do not depend on the buckets.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from lightning_sparse._utils import all_finite
from lightning_sparse.config import SparseConfig
from lightning_sparse.exchange.amp import SkippedSteps
from lightning_sparse.exchange.fallback import DENSE, SPARSE, TRIAL_DENSE, TimedFallback
from lightning_sparse.schedules import DensitySchedule
from lightning_sparse.wire import DENSE as DENSE_PATTERN
from lightning_sparse.wire import (
    GATHER,
    PATTERNS,
    Average,
    BucketCall,
    BucketPlan,
    Collectives,
    Member,
    Pending,
    WireContext,
    bucket_wire_bytes,
    count_all_gather,
    count_all_reduce,
    count_dense,
    sparse_pays,
)
from lightning_sparse.wire.comm import CollectiveError, Rounds, first_line, run
from lightning_sparse.wire.memory import ErrorFeedback, LocalMomentum
from lightning_sparse.wire.stats import Counters, Telemetry

__all__ = ["ExchangeError", "StepExchange", "wire_context"]


class ExchangeError(RuntimeError):
    """A collective of the sparse exchange failed or timed out: the message says where and what to check.

    Example:
        >>> str(ExchangeError(1, 2, "update", "the exchange of w", "all-gather", "timed out"))[:40]
        'lightning_sparse: rank 1 of 2 (update mo'
    """

    def __init__(self, rank: int, world_size: int, mode: str, where: str, what: str, cause: str) -> None:
        super().__init__(
            f"lightning_sparse: rank {rank} of {world_size} ({mode} mode): {where} failed in "
            f"its {what}: {cause}. Another rank did not take part in time: one may have stopped, crashed or be "
            "stalled (look at its log for an earlier error and at the last step it reached), or the process "
            "group's timeout is too short for this link (SparseDDPStrategy(timeout=datetime.timedelta(...)); "
            "Lightning's default is 30 minutes)."
        )


class StepExchange:
    """The exchange of one rank, one optimizer step at a time (:meth:`begin`, :meth:`bucket`, the last closes).

    Args:
        config: the settings.
        memory: the error-feedback residuals, by parameter name.
        velocity: the local momenta of momentum correction, by parameter name.
        telemetry: where each bucket's figures are recorded.

    Example:
        >>> from lightning_sparse import SparseState
        >>> state = SparseState(compressor="topk", density=0.5)
        >>> ex = state.step_exchange
        >>> ex.step, ex.in_step, ex.plain_ddp
        (0, False, False)
    """

    def __init__(self, config: SparseConfig, memory: ErrorFeedback, velocity: LocalMomentum, telemetry: Telemetry):
        self.config = config
        self.memory = memory
        self.velocity = velocity
        self.telemetry = telemetry
        #: this rank's own copy of the config's ``density`` schedule (it learns as the run goes)
        self.schedule: DensitySchedule = copy.deepcopy(config.schedule)
        #: the timed fallback of this rank's exchange (a copy of the config's), None where it is off
        self.timed_fallback: TimedFallback | None = copy.deepcopy(config.timed_fallback)
        #: optimizer steps this rank finished exchanging (saved in checkpoints)
        self.step = 0
        #: optimizer steps this rank finished, with or without an exchange
        self.optimizer_step = 0
        self.residual_norm_interval = 50  # steps between measurements of the residual norm (0: never)
        self.skips: SkippedSteps | None = None
        self.wire = self._context(Collectives(), rank=0)
        self._in_step = False
        self._plain_ddp = False
        self._loss_scale: Callable[[], float] | None = None
        self._last_loss_scale: float | None = None
        self.backward: Any = None  # gradient mode: the hook's BackwardBatch of the backward pass under way

    def _context(self, comm: Collectives, rank: int) -> WireContext:
        return wire_context(self.config, comm, rank, memory=self.memory, velocity=self.velocity)

    def bind(self, comm: Collectives, rank: int) -> None:
        """Exchange through ``comm`` (this rank's counted collectives) as rank ``rank``."""
        self.wire = self._context(comm, rank)

    def use_scaler(self, scaler: Any, rescale_residuals: bool) -> None:
        """fp16 AMP: ``scaler``'s skipped steps change nothing; ``rescale_residuals``: follow its loss scale."""
        self.skips = None if scaler is None else SkippedSteps(scaler)
        self._loss_scale = self.skips.scale if self.skips is not None and rescale_residuals else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(skips=None, _loss_scale=None, backward=None)
        state["wire"] = dataclasses.replace(self.wire, comm=Collectives())
        return state

    @property
    def in_step(self) -> bool:
        """Whether a step is open (begun, its last bucket not exchanged yet)."""
        return self._in_step

    @property
    def plain_ddp(self) -> bool:
        """Update mode with a timed fallback: whether this step is a plain DDP step."""
        return self._plain_ddp

    @property
    def world_size(self) -> int:
        return self.wire.world_size

    def begin(self) -> None:
        """Open an optimizer step: before its first bucket (a timed update-mode step: before its forward)."""
        self._in_step = True
        if self.skips is not None:
            self.skips.begin()
        if self._loss_scale is not None:  # the residuals carry the loss scale: follow it (powers of 2: exact)
            scale = float(self._loss_scale())
            last = self._last_loss_scale
            if last is not None and scale != last and last > 0:
                self.memory.scale_(scale / last)
                self.velocity.scale_(scale / last)
            self._last_loss_scale = scale
        timed = self.timed_fallback
        if timed is not None:
            sent = timed.begin_step(self.step)  # may agree on a trial: one collective, before the first bucket
            if sent:
                counters = Counters()
                count_all_reduce(counters, self.world_size, sent)
                self.telemetry.record("timed fallback", counters, "timed fallback")

    def begin_timed(self) -> tuple[bool, bool]:
        """Open the step before its forward (timed, update mode): whether it is plain DDP, and the first of them."""
        if self._in_step:
            return self._plain_ddp, False
        self.begin()
        timed = self.timed_fallback
        dense = timed is not None and timed.kind(self.step) in (DENSE, TRIAL_DENSE)
        entering = dense and not self._plain_ddp
        self._plain_ddp = dense
        return dense, entering

    def _end(self) -> None:
        self._in_step = False
        interval = self.residual_norm_interval
        if self.config.error_feedback and interval > 0 and self.step % interval == 0:
            self.telemetry.residual_norm = self.memory.norm_sq() ** 0.5
            self.telemetry.residual_norm_step = self.step
        schedule = self.schedule
        schedule_bytes = schedule.end_step(self.step)  # after the step's collectives, on this thread
        if schedule_bytes:
            counters = Counters()
            count_all_gather(counters, self.world_size, schedule_bytes)
            self.telemetry.record("density schedule", counters, "density schedule")
        self.telemetry.end_step()
        self.step += 1
        self.optimizer_step += 1

    def end_unexchanged(self) -> None:
        """Close an optimizer step that exchanged nothing; the exchange counter stays."""
        self.telemetry.end_step()
        self.optimizer_step += 1

    @property
    def times_whole_steps(self) -> bool:
        """Whether the timed fallback times whole steps (update mode, ``sync_every`` 1) up to :meth:`mark_end`."""
        c = self.config
        return self.timed_fallback is not None and c.compress == "update" and c.sync_every == 1

    def mark_end(self) -> None:
        """The optimizer step's exchange is over (the timed fallback's window closes here)."""
        timed = self.timed_fallback
        if timed is not None and self.times_whole_steps:
            timed.mark_end()

    def error(self, where: str, what: str, cause: str) -> ExchangeError:
        return ExchangeError(self.wire.rank, self.world_size, self.config.compress, where, what, cause)

    def keep_gradient(self, buffer: Tensor, last: bool) -> Future[Tensor]:
        """Update mode: keep the gradient ``buffer``; under fp16 AMP agree after the last on an overflow anywhere."""
        if self.skips is None:
            return _done(buffer)
        counters = Counters()
        where = f"the overflow check of optimizer step {self.optimizer_step}"
        future = self.skips.agree(
            self.wire.comm, buffer, last, counters, lambda what, cause: self.error(where, what, cause)
        )
        if last:
            self.telemetry.record("overflow check", counters, "overflow check")
        return future

    def bucket(
        self, buffer: Tensor, plan: BucketPlan, *, last: bool = True, inputs_finite: bool = False
    ) -> Future[Average]:
        """Exchange one bucket; a future of the average (``inputs_finite``: the patterns skip their check)."""
        return run(self.bucket_rounds(buffer, plan, last=last, inputs_finite=inputs_finite))

    def bucket_rounds(
        self, buffer: Tensor, plan: BucketPlan, *, last: bool = True, inputs_finite: bool = False
    ) -> Rounds[Future[Average]]:
        """:meth:`bucket` in rounds, for buckets driven together (``run_together``, then :meth:`close`)."""
        spent = 0.0  # this bucket's own time: the others' work between its rounds is theirs
        start = time.perf_counter()
        if not self._in_step:
            self.begin()
        config = self.config
        ctx = self.wire
        compressor = ctx.compressor
        schedule = self.schedule
        counters = Counters(numel=buffer.numel(), buckets=1)
        count_dense(counters, self.world_size, buffer.numel() * buffer.element_size())
        call = BucketCall(
            buffer,
            plan,
            self.step,
            counters,
            inputs_finite=inputs_finite,
            observe=schedule.observe if schedule.observes else None,
        )
        if self.skips is not None and config.compress == "gradient":  # restored if the scaler skips the step
            self.skips.keep(self.memory, self.velocity, [m.name for m in plan.members])
        if config.momentum_correction:
            self._apply_local_momentum(call)
        sparse = plan.sparse_members
        ks: list[int] = []
        send_sparse = False
        method = "dense (warm-up)" if sparse else "dense (small tensors)"  # for telemetry
        timed = self.timed_fallback
        past_warmup = self.step >= config.warmup_steps
        if sparse and past_warmup:
            density = schedule.density(self.step)
            ks = compressor.ks_for(plan.sparse_numels, density)
            kind = timed.kind(self.step) if timed is not None else SPARSE
            if kind == TRIAL_DENSE:
                method = "dense (timing trial)"
            elif kind == DENSE:
                counters.fallback_buckets = 1
                method = "dense (timed fallback)"
            elif config.byte_rule and not self.sparse_is_cheaper(buffer, sparse, ks):
                counters.fallback_buckets = 1
                method = "dense (fallback)"
            else:
                send_sparse = True
                method = compressor.name or type(compressor).__name__
                if self._exchange_of(buffer, sparse, ks) == "split":
                    method += " (split)"  # what exchange="auto" picked
        where = f"the exchange of {plan.label} ({method}) at optimizer step {self.optimizer_step}"
        if self.optimizer_step != self.step:
            where += f" (exchange {self.step})"
        try:
            if send_sparse:
                rounds = PATTERNS[compressor.pattern].launch_rounds(ctx, call, ks)
                while True:
                    try:
                        next(rounds)
                    except StopIteration as stop:
                        sparse_part = stop.value
                        break
                    spent += time.perf_counter() - start
                    yield
                    start = time.perf_counter()
                parts = [sparse_part, DENSE_PATTERN.launch_members(ctx, call, plan.dense_members)]
            elif not sparse and config.value_bits is not None and config.compress == "update" and past_warmup:
                counters.dense_buckets = 1
                parts = [DENSE_PATTERN.launch_members(ctx, call, plan.dense_members)]
            else:
                counters.dense_buckets = 1
                parts = [DENSE_PATTERN.launch(ctx, call)]
        except CollectiveError as error:  # waited for on this thread (split, sketch)
            raise self.error(where, error.what, error.cause) from error
        future = self._average(buffer, parts, where)
        if timed is not None:
            future = timed.track(future)
        counters.compress_seconds = spent + time.perf_counter() - start
        self.telemetry.record(plan.label, counters, method)
        if last:
            self._end()
        return future

    def close(self) -> None:
        """Close the step after buckets exchanged with ``last=False`` (driven together)."""
        if self._in_step:
            self._end()

    def sparse_is_cheaper(self, buffer: Tensor, sparse: tuple[Member, ...], ks: list[int]) -> bool:
        """The byte rule: whether sparse moves fewer (ring-model) bytes than dense for the ``sparse`` members."""
        ctx = self.wire
        vbytes = ctx.vdtype(buffer).itemsize
        numels = [m.numel for m in sparse]
        wire = bucket_wire_bytes(ctx, ks, numels, vbytes, world=self.world_size)
        return sparse_pays(wire, self.world_size, sum(numels) * buffer.element_size())

    def _exchange_of(self, buffer: Tensor, sparse: tuple[Member, ...], ks: list[int]) -> str | None:
        ctx = self.wire
        if ctx.compressor.pattern != "gather":
            return None
        return GATHER.exchange_for(ctx, ks, [m.numel for m in sparse], ctx.vdtype(buffer).itemsize)

    def _average(self, buffer: Tensor, parts: list[Pending], where: str) -> Future[Average]:
        """A future of the bucket's :class:`Average` (one that raises :class:`ExchangeError` if a collective failed)."""
        issued = [f for part in parts for f in part.futures]

        def finish(_: Any) -> Average:
            for f in issued:
                try:
                    f.future.value()
                except Exception as error:
                    return Average(buffer, parts, self.error(where, f.what, first_line(error)), parties=self.world_size)
            return Average(buffer, parts, waits=issued, parties=self.world_size)

        if not issued:
            return _done(finish(None))
        # collect_all even for one: then() on a CUDA future records its value's streams; Average.add_to waits itself
        return torch.futures.collect_all([f.future for f in issued]).then(finish)

    def _apply_local_momentum(self, call: BucketCall) -> None:
        """Momentum correction: each gradient becomes ``u = m*u + g``, in the bucket and (float32) ``call.sources``."""
        for m in call.plan.members:
            segment = call.segment(m)
            if not all_finite(segment):
                continue
            u = self.velocity.update(m.name, segment, self.config.momentum_correction)
            segment.copy_(u)
            call.sources[m.name] = u

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "optimizer_step": self.optimizer_step, "last_loss_scale": self._last_loss_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.optimizer_step = int(state.get("optimizer_step", self.step))
        self._last_loss_scale = state.get("last_loss_scale")

    @property
    def last_loss_scale(self) -> float | None:
        """The gradient scaler's loss scale at the last step's start (gradient mode under fp16)."""
        return self._last_loss_scale


def wire_context(
    config: SparseConfig,
    comm: Collectives | None = None,
    rank: int = 0,
    *,
    memory: ErrorFeedback | None = None,
    velocity: LocalMomentum | None = None,
) -> WireContext:
    """The :class:`~lightning_sparse.wire.WireContext` of ``config``, with this rank's stores and collectives.

    Example:
        >>> ctx = wire_context(SparseConfig(exchange="allgather"))
        >>> ctx.exchange, ctx.world_size
        ('allgather', 1)
    """
    return WireContext(
        compressor=config.compressor,  # type: ignore[arg-type]  # resolved to a Compressor by the config
        error_feedback=config.error_feedback,
        momentum_correction=config.momentum_correction,
        value_dtype=config.value_dtype,  # type: ignore[arg-type]  # resolved to a dtype or None by the config
        seed=config.seed,
        exchange=config.exchange,
        compact_indices=config.compact_indices,
        value_bits=config.value_bits,
        byte_rule=config.byte_rule,
        memory=ErrorFeedback() if memory is None else memory,
        velocity=LocalMomentum() if velocity is None else velocity,
        comm=Collectives() if comm is None else comm,
        rank=rank,
        fixed_buckets=config.compress == "update",
    )


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut
