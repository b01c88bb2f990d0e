"""One optimizer step of the exchange on one rank: its counter, its bookkeeping and its buckets.

:class:`StepExchange` owns what an optimizer step of the sparse exchange is, whichever front end
drives it: the step counter and whether a step is open (:meth:`~StepExchange.begin`, then
:meth:`~StepExchange.bucket` once per bucket, the last one closing the step), the rescale of the
residuals when a gradient scaler changes its loss scale, the fp16 overflow agreement of update
mode (:meth:`~StepExchange.keep_gradient`), the timed fallback's choice of a plain DDP step
(:meth:`~StepExchange.begin_timed`), and the exchange of a bucket itself: dense or sparse, which
wire pattern, the telemetry, and the :class:`~lightning_sparse.wire.Average` of what the ranks
sent. Where that average lands is the caller's: DDP's gradient hook (:mod:`lightning_sparse.exchange.hook`)
writes it into the bucket, update mode (:mod:`lightning_sparse.exchange.update`) hands it to an outer step.

Compression is per parameter (each sparse parameter sends ``k = round(density * numel)``
coordinates, at least 1), so results do not depend on how parameters are grouped into buckets;
communication is per bucket. Parameters below ``min_numel`` go dense, in the same step.
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
from lightning_sparse.exchange.memory import ErrorFeedback, LocalMomentum
from lightning_sparse.schedules import DensitySchedule
from lightning_sparse.telemetry.stats import Counters, Telemetry
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

__all__ = ["ExchangeError", "StepExchange", "wire_context"]


class ExchangeError(RuntimeError):
    """A collective of the sparse exchange failed or timed out: the message says where (the bucket,
    the way it was sent, the optimizer step, the collective, the rank) and what to check.

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
    """The exchange of one rank, one optimizer step at a time.

    Built by :class:`~lightning_sparse.exchange.state.SparseState` around its stores (residuals, local
    momenta, telemetry), and bound to a process group through :meth:`bind`. A step opens with
    :meth:`begin` (or with its first bucket) and closes after its last bucket (``last=True``),
    which advances :attr:`step`.

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
        # The config holds values: what learns or measures as the run goes (an adaptive density's
        # statistics, the timed fallback's clock and choice) is this rank's own copy, kept here.
        #: the density schedule of this rank's exchange (a copy of the config's ``density``)
        self.schedule: DensitySchedule = copy.deepcopy(config.schedule)
        #: the timed fallback of this rank's exchange (a copy of the config's), None where it is off
        self.timed_fallback: TimedFallback | None = copy.deepcopy(config.timed_fallback)
        #: optimizer steps this rank finished exchanging (saved in checkpoints)
        self.step = 0
        #: optimizer steps this rank finished, with or without an exchange (local steps count here
        #: only); errors name the step by it
        self.optimizer_step = 0
        #: the residual norm is measured every this many steps (0: never; CompressionMonitor
        #: measures it itself when it logs)
        self.residual_norm_interval = 50
        #: what a step that the fp16 gradient scaler skips does (:meth:`use_scaler`)
        self.skips: SkippedSteps | None = None
        self.wire = self._context(Collectives(), rank=0)
        self._in_step = False
        self._plain_ddp = False
        self._loss_scale: Callable[[], float] | None = None
        self._last_loss_scale: float | None = None
        #: the buckets of the backward pass under way, in DDP's hook (gradient mode): the hook's
        #: ``BackwardBatch`` (:mod:`lightning_sparse.exchange.hook`, a layer above this one)
        self.backward: Any = None

    def _context(self, comm: Collectives, rank: int) -> WireContext:
        return wire_context(self.config, comm, rank, memory=self.memory, velocity=self.velocity)

    def bind(self, comm: Collectives, rank: int) -> None:
        """Exchange through ``comm`` (this rank's counted collectives) as rank ``rank``."""
        self.wire = self._context(comm, rank)

    def use_scaler(self, scaler: Any, rescale_residuals: bool) -> None:
        """Under fp16 AMP (``scaler``: the precision plugin's enabled gradient scaler, or None): steps
        the scaler skips change nothing (:class:`~lightning_sparse.exchange.amp.SkippedSteps`); with
        ``rescale_residuals`` (gradient mode: the residuals carry the loss scale) the residuals
        follow each change of the loss scale."""
        self.skips = None if scaler is None else SkippedSteps(scaler)
        self._loss_scale = self.skips.scale if self.skips is not None and rescale_residuals else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(skips=None, _loss_scale=None, backward=None)
        state["wire"] = dataclasses.replace(self.wire, comm=Collectives())
        return state

    # ------------------------------------------------------------------ the step
    @property
    def in_step(self) -> bool:
        """Whether a step is open (begun, its last bucket not exchanged yet)."""
        return self._in_step

    @property
    def plain_ddp(self) -> bool:
        """Update mode with a timed fallback: whether this step is a plain DDP step (gradients
        all-reduced in DDP's hook, nothing exchanged after the optimizer step)."""
        return self._plain_ddp

    @property
    def world_size(self) -> int:
        return self.wire.world_size

    def begin(self) -> None:
        """Open an optimizer step: before its first bucket (or, in update mode with a timed
        fallback, before its forward: the way the step sends must be known then)."""
        self._in_step = True
        if self.skips is not None:
            self.skips.begin()
        if self._loss_scale is not None:
            # With a gradient scaler the gradients (and so the residuals) carry the loss scale. When the
            # scaler changes it (halved after an overflow, doubled after a run of good steps), bring the
            # residuals to the new scale so they keep their weight; the ratio is a power of 2: exact.
            scale = float(self._loss_scale())
            last = self._last_loss_scale
            if last is not None and scale != last and last > 0:
                self.memory.scale_(scale / last)
                self.velocity.scale_(scale / last)
            self._last_loss_scale = scale
        timed = self.timed_fallback
        if timed is not None:
            # may agree on a trial's outcome (one small collective, issued here, before this step's
            # first bucket, at the same step on every rank)
            sent = timed.begin_step(self.step)
            if sent:  # the decision is one all-reduce
                counters = Counters()
                count_all_reduce(counters, self.world_size, sent)
                self.telemetry.record("timed fallback", counters, "timed fallback")

    def begin_timed(self) -> tuple[bool, bool]:
        """Update mode with a timed fallback and a ``sync_every`` of 1: open the step before its
        forward and settle how it sends. Returns whether it is a plain DDP step (the trial's dense
        steps and a dense choice), and whether it is the first of a run of them (the caller then
        brings the ranks' replicas together)."""
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
        # on the exchanging thread, after the step's collectives; an adaptive density gathers its statistics
        schedule = self.schedule
        schedule_bytes = schedule.end_step(self.step)
        if schedule_bytes:  # the statistics are all-gathered (DensitySchedule.end_step)
            counters = Counters()
            count_all_gather(counters, self.world_size, schedule_bytes)
            self.telemetry.record("density schedule", counters, "density schedule")
        self.telemetry.end_step()
        self.step += 1
        self.optimizer_step += 1

    def end_unexchanged(self) -> None:
        """Close the telemetry's step of an optimizer step that exchanged nothing (a local step
        between exchanges, a step every rank's scaler skipped); the exchange counter stays."""
        self.telemetry.end_step()
        self.optimizer_step += 1

    @property
    def times_whole_steps(self) -> bool:
        """Update mode with a timed fallback and a ``sync_every`` of 1: the fallback times whole steps
        (up to :meth:`mark_end`) and may make them plain DDP steps (:meth:`begin_timed`)."""
        c = self.config
        return self.timed_fallback is not None and c.compress == "update" and c.sync_every == 1

    def mark_end(self) -> None:
        """The optimizer step's exchange is over (the timed fallback's window closes here)."""
        timed = self.timed_fallback
        if timed is not None and self.times_whole_steps:
            timed.mark_end()

    def error(self, where: str, what: str, cause: str) -> ExchangeError:
        """The :class:`ExchangeError` of this rank for a collective ``what`` that failed ``where``."""
        return ExchangeError(self.wire.rank, self.world_size, self.config.compress, where, what, cause)

    # ------------------------------------------------------------------ update mode's own gradient
    def keep_gradient(self, buffer: Tensor, last: bool) -> Future[Tensor]:
        """Update mode (:meth:`Replicas.gradients_ready <lightning_sparse.exchange.replicas.Replicas.gradients_ready>`):
        keep this rank's own gradient ``buffer``, send nothing; under fp16 AMP agree with every rank,
        after the step's last gradient, on whether one overflowed anywhere (every rank's scaler then
        skips the step)."""
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

    # ------------------------------------------------------------------ one bucket
    def bucket(
        self, buffer: Tensor, plan: BucketPlan, *, last: bool = True, inputs_finite: bool = False
    ) -> Future[Average]:
        """Exchange one bucket and return (a future of) the average of what the ranks sent.

        ``buffer`` is the flat input of the bucket's parameters laid out as ``plan`` says (DDP's
        sum-ready gradient, or update mode's progress). ``last``: the step's last bucket (the step
        closes). ``inputs_finite``: the caller made every input finite (the update exchange drops
        a non-finite update on its rank), so the patterns skip their own per-tensor check.
        """
        return run(self.bucket_rounds(buffer, plan, last=last, inputs_finite=inputs_finite))

    def bucket_rounds(
        self, buffer: Tensor, plan: BucketPlan, *, last: bool = True, inputs_finite: bool = False
    ) -> Rounds[Future[Average]]:
        """:meth:`bucket` in rounds (:data:`~lightning_sparse.wire.comm.Rounds`): it yields after
        issuing a first round whose result the bucket needs (the split and count-sketch
        exchanges), so that several buckets driven together
        (:func:`~lightning_sparse.wire.comm.run_together`) issue their rounds together. With
        several buckets driven together, close the step after the last one with :meth:`close`
        rather than ``last=True``."""
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
        if self.skips is not None and config.compress == "gradient":
            # fp16 AMP: what the exchange takes from the residuals comes back if the scaler skips the step
            self.skips.keep(self.memory, self.velocity, [m.name for m in plan.members])
        if config.momentum_correction:
            self._apply_local_momentum(call)
        sparse = plan.sparse_members
        ks: list[int] = []
        send_sparse = False
        method = "dense (warm-up)" if sparse else "dense (small tensors)"  # how the bucket is sent, for telemetry
        timed = self.timed_fallback
        past_warmup = self.step >= config.warmup_steps
        if sparse and past_warmup:
            density = schedule.density(self.step)
            ks = compressor.ks_for(plan.sparse_numels, density)  # as many as the compressor sends
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
                    method += " (split)"  # what exchange="auto" picked shows in the telemetry's rows
        where = f"the exchange of {plan.label} ({method}) at optimizer step {self.optimizer_step}"
        if self.optimizer_step != self.step:  # local steps, or skipped ones: the exchanges counted apart
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
                # a bucket of small tensors only (a fragment can be one): coded like the small
                # tensors beside a sparse send, where that moves fewer bytes
                counters.dense_buckets = 1
                parts = [DENSE_PATTERN.launch_members(ctx, call, plan.dense_members)]
            else:
                counters.dense_buckets = 1
                parts = [DENSE_PATTERN.launch(ctx, call)]
        except CollectiveError as error:  # a collective waited for on this thread (split, sketch)
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
        """The byte rule for a bucket: ring-model wire bytes of the sparse exchange of its ``sparse``
        members vs a dense all-reduce of them (:func:`~lightning_sparse.wire.sparse_pays`).

        The dense parts of the bucket cost the same either way and are left out. World size 1 moves
        nothing either way: dense is then exact and free.
        """
        ctx = self.wire
        vbytes = ctx.vdtype(buffer).itemsize
        numels = [m.numel for m in sparse]
        wire = bucket_wire_bytes(ctx, ks, numels, vbytes, world=self.world_size)
        return sparse_pays(wire, self.world_size, sum(numels) * buffer.element_size())

    def _exchange_of(self, buffer: Tensor, sparse: tuple[Member, ...], ks: list[int]) -> str | None:
        """The exchange a gather-pattern bucket takes (None for the other patterns)."""
        ctx = self.wire
        if ctx.compressor.pattern != "gather":
            return None
        return GATHER.exchange_for(ctx, ks, [m.numel for m in sparse], ctx.vdtype(buffer).itemsize)

    def _average(self, buffer: Tensor, parts: list[Pending], where: str) -> Future[Average]:
        """A future of the bucket's :class:`Average`, once every collective of its parts completed (an
        Average that raises :class:`ExchangeError` when used, if one failed)."""
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
        # collect_all even for one future: then() on a CUDA future (NCCL's) records the streams of
        # the tensors in its callback's value, which an Average does not hand out; the Average
        # makes the using stream wait for the collectives itself (Average.add_to)
        return torch.futures.collect_all([f.future for f in issued]).then(finish)

    def _apply_local_momentum(self, call: BucketCall) -> None:
        """Momentum correction: each member's gradient becomes its local momentum ``u = m*u + g``.

        ``u`` is written into the bucket (what a dense send then sends: averaging momenta is the
        momentum of the average) and kept in float32 in ``call.sources`` for the sparse paths, so no
        precision is lost to the bucket's dtype there. Non-finite gradients are left as they are.
        """
        for m in call.plan.members:
            segment = call.segment(m)
            if not all_finite(segment):
                continue
            u = self.velocity.update(m.name, segment, self.config.momentum_correction)
            segment.copy_(u)
            call.sources[m.name] = u

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The step counters and the last loss scale seen."""
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
    """The :class:`~lightning_sparse.wire.WireContext` of ``config``: the one place the wire code's
    settings are taken from the config, with this rank's stores and counted collectives.

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
