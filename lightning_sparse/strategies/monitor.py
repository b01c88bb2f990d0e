"""CompressionMonitor: the sparse hook's telemetry in the Trainer's loggers, and a summary at the end of fit."""

from __future__ import annotations

import copy
import time
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_sparse._utils import check_bool
from lightning_sparse.exchange.state import SparseState
from lightning_sparse.telemetry.summary import CompressionSummary, fit_title
from lightning_sparse.wire.stats import Counters, Telemetry

#: what the summary says on one process instead of an empty table
ONE_PROCESS = (
    "one process, nothing exchanged (the sparse exchange runs between processes; this fit trained as plain Lightning)."
)
#: shown on the progress bar: how far the global model lags (update mode), and the bytes saved so far
PROGRESS_BAR_NAMES = ("sparse/unsent_ratio", "sparse/compression_ratio_cumulative")


def compression_figures(
    interval: Counters,
    steps: int,
    total: Counters,
    residual_norm: float,
    unsent_ratio: float | None = None,
    group_bytes: float | None = None,
) -> dict[str, float]:
    """The logged figures for ``steps`` optimizer steps whose counters add up to ``interval`` (``total``: the whole
    run's); compression ratio: dense wire bytes / wire bytes (ring model), message ratio: dense bytes / bytes sent."""
    steps = max(steps, 1)
    return {
        "sparse/compression_ratio": interval.compression_ratio,
        "sparse/compression_ratio_cumulative": total.compression_ratio,
        "sparse/message_ratio": interval.message_ratio,
        "sparse/density": interval.density,
        "sparse/bytes_sent": interval.sent_bytes / steps,
        "sparse/bytes_sent_total": float(total.sent_bytes),
        "sparse/wire_bytes": interval.wire_bytes / steps,
        "sparse/wire_bytes_total": float(total.wire_bytes),
        "sparse/residual_norm": float(residual_norm),
        "sparse/compress_ms": 1000.0 * interval.compress_seconds / steps,
        "sparse/collectives": interval.collectives / steps,
        **({} if unsent_ratio is None else {"sparse/unsent_ratio": float(unsent_ratio)}),
        **({} if group_bytes is None else {"sparse/group_bytes": float(group_bytes) / steps}),
    }


#: the metric names CompressionMonitor logs (but update mode's and ``sparse_fsdp``'s)
METRIC_NAMES = tuple(compression_figures(Counters(), 1, Counters(), 0.0))


class CompressionMonitor(Callback):
    """Log the compression figures (:func:`compression_figures`) through ``pl_module.log`` and print a summary.

    Each logged point covers the optimizer steps since the previous one; ``trainer.callback_metrics`` holds the
    latest. The sparse strategies add one unless one is given or ``compression_monitor=False``.

    Args:
        logging_interval: ``"step"`` (at the Trainer's ``log_every_n_steps``) or ``"epoch"``.
        summary: print a table of the fit's figures on rank 0 when training ends.
        sync_dist: average the figures over ranks before logging. ``None``: ``True`` with ``"epoch"``, ``False``
            with ``"step"``.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning_sparse.strategies.monitor import CompressionMonitor
        >>> monitor = CompressionMonitor(logging_interval="step")
        >>> trainer = Trainer(strategy="sparse_ddp", callbacks=[monitor], log_every_n_steps=10)  # doctest: +SKIP
    """

    def __init__(
        self, logging_interval: Literal["step", "epoch"] = "step", summary: bool = True, sync_dist: bool | None = None
    ) -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(f"logging_interval={logging_interval!r} is not allowed: expected 'step' or 'epoch'.")
        check_bool("summary", summary)
        if sync_dist is not None and not isinstance(sync_dist, bool):
            raise ValueError(f"sync_dist={sync_dist!r} is not allowed: expected None, True or False.")
        self.logging_interval = logging_interval
        self.summary = summary
        self.sync_dist = sync_dist
        self._state: SparseState | None = None
        self._fit_start: Telemetry | None = None
        #: the counters and steps at the last logged point, and at the epoch's start
        self._logged: tuple[Counters, int] = (Counters(), 0)
        self._epoch_start: tuple[Counters, int] = (Counters(), 0)
        self._logged_group_bytes = 0.0
        self._step_seconds = 0.0
        self._batch_start: float | None = None
        self._saved_interval: int | None = None
        self.last_summary: CompressionSummary | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        state = getattr(trainer.strategy, "sparse_state", None)
        self._state = state if isinstance(state, SparseState) else None
        if self._state is None:
            rank_zero_warn(
                f"CompressionMonitor logs the figures of SparseDDPStrategy, but the Trainer uses "
                f"{type(trainer.strategy).__name__}; it will log nothing."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self._state
        if state is None:
            return
        telemetry = state.telemetry
        self._fit_start = copy.deepcopy(telemetry)
        self._logged = self._epoch_start = (telemetry.total.copy(), telemetry.steps)
        self._logged_group_bytes = telemetry.group_bytes or 0.0
        self._step_seconds = 0.0
        # the residual norm costs a read of every residual: measured only when logging
        self._saved_interval = state.residual_norm_interval
        state.residual_norm_interval = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._batch_start is not None:
            self._step_seconds += time.perf_counter() - self._batch_start
            self._batch_start = None
        if self._state is not None and self.logging_interval == "step":
            telemetry, (logged, steps) = self._state.telemetry, self._logged
            # where the Trainer writes step metrics to its loggers after this batch (every step if its internals moved)
            connector = getattr(trainer, "_logger_connector", None)
            if telemetry.steps > steps and getattr(connector, "should_update_logs", True):
                self._log(trainer, pl_module, telemetry.total - logged, telemetry.steps - steps, True)
                self._logged = (telemetry.total.copy(), telemetry.steps)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._state is not None:
            self._epoch_start = (self._state.telemetry.total.copy(), self._state.telemetry.steps)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._state is not None and self.logging_interval == "epoch":
            telemetry, (start, start_steps) = self._state.telemetry, self._epoch_start
            if telemetry.steps > start_steps:
                self._log(trainer, pl_module, telemetry.total - start, telemetry.steps - start_steps, False)

    def _log(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, interval: Counters, steps: int, on_step: bool
    ) -> None:
        state = self._state
        assert state is not None
        norm = state.measure_residual_norm()
        group = state.telemetry.group_bytes
        inside = None if group is None else group - self._logged_group_bytes
        self._logged_group_bytes = group or 0.0
        figures = compression_figures(
            interval, steps, state.telemetry.total, norm, state.measure_unsent_ratio(), inside
        )
        update = getattr(trainer.strategy, "update_exchange", None)
        replicas = getattr(getattr(update, "commit", None), "replica_figures", None)
        if replicas is not None:  # fault_tolerant: groups in the last quorum, rollbacks, heals
            figures.update(replicas())
        if update is not None:  # update mode: the tensor updates this rank dropped as non-finite
            figures["sparse/nonfinite_updates"] = float(update.nonfinite_updates)
        sync_dist = self.sync_dist if self.sync_dist is not None else not on_step
        log = partial(pl_module.log, on_step=on_step, on_epoch=not on_step, sync_dist=sync_dist, batch_size=1)
        for name, value in figures.items():
            log(name, value, prog_bar=name in PROGRESS_BAR_NAMES, logger=bool(trainer.loggers))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self._state
        if state is None:
            return
        if self._saved_interval is not None:
            state.residual_norm_interval = self._saved_interval
            self._saved_interval = None
        if not self.summary:
            return
        self.last_summary = self.build_summary(trainer)
        if not trainer.is_global_zero:
            return
        update = getattr(trainer.strategy, "update_exchange", None)
        exchanging = update.active if update is not None else state.world_size > 1
        # gradient mode's hook runs on one process too (DDP calls it), but its all-reduces move nothing
        if not exchanging and not self.last_summary.total.wire_bytes:
            print(f"Sparse {state.config.compress} communication: {ONE_PROCESS}", flush=True)
        else:
            self.last_summary.print()

    def build_summary(self, trainer: pl.Trainer) -> CompressionSummary:
        """The summary of the fit so far (this rank's figures since training started)."""
        state = self._state
        assert state is not None
        start = self._fit_start
        steps = state.telemetry.steps - (start.steps if start is not None else 0)
        title = fit_title(state.config, steps, trainer.global_rank, trainer.world_size)
        summary = CompressionSummary.from_telemetry(
            state.telemetry, start, step_seconds=self._step_seconds or None, title=title
        )
        summary.notes.append(
            "wire bytes = what this rank's collectives moved through it (ring model); dense wire = the same "
            "for a dense all-reduce; ratio = dense wire / wire bytes; msg ratio = dense bytes / bytes put "
            "into the collectives; % of step = time in the hook / training step time."
        )
        if state.timed_fallback is not None and state.timed_fallback.describe():
            summary.notes.append(str(state.timed_fallback.describe()))
        return summary
