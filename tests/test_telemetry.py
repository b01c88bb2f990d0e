"""Telemetry: honest byte counts, CompressionMonitor in real Trainer runs, torchmetrics, the summary."""

from __future__ import annotations

import csv
import io
import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_trainer

from lightning_sparse import COMPRESSORS, CompressionMonitor, SparseDDPStrategy
from lightning_sparse.strategies.monitor import METRIC_NAMES, ONE_PROCESS
from lightning_sparse.telemetry.summary import ADDS_UP, CompressionSummary, format_bytes
from lightning_sparse.wire.stats import Counters, Telemetry


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------- bytes on the wire
_TAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
)
_INPUT_POSITION = {"all_reduce": 0, "broadcast": 0}


def _wire_worker(rank: int, world: int, compressor: str) -> dict[str, Any]:
    """Run the hook on buckets of mixed sizes; count the input bytes of every collective it calls."""
    import torch.distributed as dist

    from lightning_sparse.exchange.hook import communicate
    from lightning_sparse.exchange.state import SparseState

    shapes = {"a.weight": (60, 50), "a.bias": (60,), "b.weight": (5000,), "c.bias": (9,), "d.weight": (40, 40)}
    named = [(n, torch.zeros(s, requires_grad=True)) for n, s in shapes.items()]
    buckets = [[named[0][1], named[1][1], named[2][1]], [named[3][1]], [named[4][1]]]
    # no dense fallback: every compressor takes its own path (count-sketch would go dense here)
    state = SparseState(
        compressor=compressor, density=0.03, min_numel=500, warmup_steps=1, seed=3, fallback_to_dense=False
    )
    state.bind(named)

    wire = {"bytes": 0, "calls": 0}
    real = {name: getattr(dist, name) for name in _TAPPED if hasattr(dist, name)}
    depth = {"n": 0}

    def tap(name: str) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            if depth["n"] == 0:  # all_gather_into_tensor calls all_gather_single: count the outer call
                tensor = args[_INPUT_POSITION.get(name, 1)]
                wire["bytes"] += tensor.numel() * tensor.element_size()
                wire["calls"] += 1
            depth["n"] += 1
            try:
                return real[name](*args, **kwargs)
            finally:
                depth["n"] -= 1

        return collective

    for name in real:
        setattr(dist, name, tap(name))
    gen = torch.Generator().manual_seed(rank)
    per_step = []
    try:
        for _ in range(4):
            before = wire["bytes"]
            futures = []
            for i, params in enumerate(buckets):
                g = torch.randn(sum(p.numel() for p in params), generator=gen)
                futures.append(communicate(state, g, params, is_last=i == len(buckets) - 1))
            for future in futures:  # the buckets leave together after the last one
                future.wait()
            per_step.append((wire["bytes"] - before, state.telemetry.last.sent_bytes))
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"wire": wire, "per_step": per_step, "total": state.telemetry.total, "methods": state.telemetry.methods}


@pytest.mark.dist
@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
def test_counted_bytes_are_the_bytes_handed_to_collectives(dist2, compressor: str) -> None:
    """Every registered compressor: the counters equal the input bytes of the collectives, step by step."""
    for r in dist2.run(_wire_worker, compressor=compressor):
        for wire_bytes, counted in r["per_step"]:
            assert counted == wire_bytes
        total: Counters = r["total"]
        assert total.sent_bytes == r["wire"]["bytes"]
        assert total.dense_bytes == 4 * 4 * (60 * 50 + 60 + 5000 + 9 + 40 * 40)
        methods = r["methods"]
        # step 0 is warm-up; c.bias (9 elements) is always a dense bucket on its own
        assert methods["dense (warm-up)"].buckets == 2
        assert methods["dense (small tensors)"].buckets == 4
        assert methods[compressor].buckets == 6
        assert sum(c.sent_bytes for c in methods.values()) == total.sent_bytes


@pytest.mark.dist
def test_fit_logs_the_figures_through_the_logger(tmp_path: Path) -> None:
    """2-process fit, no callback given: the strategy's own monitor writes the figures to CSV, and
    they agree with the bytes the hook handed to torch.distributed (intercepted in the worker)."""
    steps = 12
    cfg = {
        "max_steps": steps,
        "strategy": {"compressor": "topk", "density": 0.05, "bucket_cap_mb": 0.02, "min_numel": 256},
        "logger": "csv",
        "log_every_n_steps": 1,
        "intercept_collectives": True,
    }
    results = run_trainer(cfg, tmp_path)
    r0 = results[0]
    assert r0["callbacks"].count("CompressionMonitor") == 1
    rows = [row for row in read_csv(tmp_path / "csv" / "version_0" / "metrics.csv") if row.get(METRIC_NAMES[0])]
    assert [int(row["step"]) for row in rows] == list(range(steps))
    wire = r0["wire_bytes_by_step"]
    assert sorted(wire) == list(range(steps))
    for row in rows:
        s = int(row["step"])
        figures = {name: float(row[name]) for name in METRIC_NAMES}
        assert all(math.isfinite(v) for v in figures.values())
        # bytes this step: exactly what the collectives were handed (float32 in the log)
        assert figures["sparse/bytes_sent"] == pytest.approx(wire[s], rel=1e-6)
        assert figures["sparse/compression_ratio"] == pytest.approx(r0["param_bytes"] / wire[s], rel=1e-5)
        assert figures["sparse/compress_ms"] > 0
        if s == 0:  # dense warm-up step
            assert figures["sparse/compression_ratio"] == pytest.approx(1.0)
            assert figures["sparse/density"] == pytest.approx(1.0)
        else:
            assert figures["sparse/compression_ratio"] > 3
            assert 0.05 <= figures["sparse/density"] < 0.2
            assert figures["sparse/residual_norm"] > 0
            assert 0 < float(row["sparse/unsent_ratio"]) < 1  # the unsent part against the global model
    # the cumulative ratio against the one computed independently from the intercepted bytes
    independent = steps * r0["param_bytes"] / sum(wire.values())
    logged = float(rows[-1]["sparse/compression_ratio_cumulative"])
    assert abs(logged / independent - 1) < 0.10
    assert logged == pytest.approx(independent, rel=1e-5)
    # the latest figures are in callback_metrics on every rank
    for r in results:
        assert set(METRIC_NAMES) <= set(r["callback_metrics"])
    # the summary: once, on rank 0, in plain text (the output is a pipe), with the fit's totals
    out = (tmp_path / "log.txt").read_text()
    assert out.count("Sparse update communication: TopK(fast=True)") == 1
    # the header names every setting given a value other than its default, in declaration order
    title = "ConstantDensity(density=0.05); min_numel=256, bucket_cap_mb=0.02; 12 steps, rank 0 of 2"
    assert title in out
    t = r0["telemetry"]
    total_line = next(line for line in out.splitlines() if line.startswith("all buckets"))
    assert format_bytes(t["dense_bytes"]) in total_line and format_bytes(t["sent_bytes"]) in total_line
    assert f"{t['dense_bytes'] / t['sent_bytes']:.1f}x" in total_line
    assert "\u2501" not in out and "\u2503" not in out  # no box drawing when not a terminal
    # the hand-over at the end of fit (flush_at_end, the default): a row of its own, one dense float32
    # all-reduce of every parameter (at 2 ranks the ring moves its size through a rank), all coordinates
    # sent, no dense DDP counterpart; the footer counts it against the table's wire bytes
    assert r0["methods"]["dense (flush)"] == 1
    rows_by_name = {re.split(r"\s{2,}", line)[0]: re.split(r"\s{2,}", line)[1:] for line in out.splitlines()}
    handover = format_bytes(r0["param_bytes"])
    assert rows_by_name["dense (hand-over at the end)"][:6] == ["1", "0 B", handover, "-", "-", "1.0000"]
    share = 100.0 * r0["param_bytes"] / t["wire_bytes"]
    footer = f"row 'dense (hand-over at the end)', not in the largest step) moved {handover} through this rank"
    assert f"{footer}, {share:.0f}% of the wire bytes" in " ".join(out.split())


@pytest.mark.dist
def test_one_process_summary_says_nothing_is_exchanged(tmp_path: Path) -> None:
    """On one process the exchange never runs: the summary is one line saying so, not an empty table."""
    runs = run_trainer(
        {
            "max_steps": 4,
            "devices": 1,
            "runs": [{"name": "update", "strategy": {}}, {"name": "gradient", "strategy": {"compress": "gradient"}}],
        },
        tmp_path,
    )
    out = (tmp_path / "log.txt").read_text()
    for mode in ("update", "gradient"):
        assert runs[mode][0]["telemetry"]["wire_bytes"] == 0  # gradient mode's hook runs, moving nothing
        assert out.count(f"Sparse {mode} communication: {ONE_PROCESS}") == 1, out[-3000:]
    assert "all buckets" not in out and "rank 0 of 1" not in out  # no table, no header above one


def _run_spawn_worker(config: dict[str, Any], out_dir: Path, timeout: float = 300) -> dict[str, Any]:
    """tests/trainer_worker.py with a spawn strategy: only the main process (rank 0) returns from fit."""
    import json
    import os
    import subprocess
    import sys

    from lightning_sparse._utils import free_port

    (out_dir / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    env.pop("LOCAL_RANK", None)
    worker = Path(__file__).parent / "trainer_worker.py"
    proc = subprocess.run(
        [sys.executable, str(worker), str(out_dir / "config.json")],
        cwd=out_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    (out_dir / "log.txt").write_text(proc.stdout + "\n" + proc.stderr)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    return torch.load(out_dir / "rank0.pt", weights_only=False)


@pytest.mark.dist
def test_spawn_figures_reach_the_main_process(tmp_path: Path) -> None:
    cfg = {"max_steps": 6, "strategy": "sparse_ddp_spawn", "logger": "csv", "log_every_n_steps": 1}
    r0 = _run_spawn_worker(cfg, tmp_path)
    metrics = r0["callback_metrics"]
    assert set(METRIC_NAMES) <= set(metrics)
    assert metrics["sparse/compression_ratio"] > 3 and metrics["sparse/compression_ratio_cumulative"] > 1
    rows = [row for row in read_csv(tmp_path / "csv" / "version_0" / "metrics.csv") if row.get(METRIC_NAMES[0])]
    assert len(rows) == 6
    assert "Sparse update communication" in (tmp_path / "log.txt").read_text()


# --------------------------------------------------------------------------- the strategy adds a monitor
def _connect(strategy: SparseDDPStrategy, callbacks: list, fn: str = "fit") -> list:
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_sparse.demos import DigitsClassifier

    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, callbacks=callbacks, logger=False)
    model = DigitsClassifier(hidden=(8,))
    model.trainer = trainer
    trainer.state.fn = TrainerFn(fn)
    trainer.strategy.connect(model)
    trainer.strategy.connect(model)  # every run connects again: still one monitor
    return [cb for cb in trainer.callbacks if isinstance(cb, CompressionMonitor)]


def test_strategy_adds_a_monitor_unless_given_or_told_not_to() -> None:
    (added,) = _connect(SparseDDPStrategy(), [])
    assert added.logging_interval == "step" and added.summary
    mine = CompressionMonitor(logging_interval="epoch", summary=False)
    assert _connect(SparseDDPStrategy(), [mine]) == [mine]
    assert _connect(SparseDDPStrategy(compression_monitor=False), []) == []
    assert _connect(SparseDDPStrategy(), [], fn="validate") == []


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"logging_interval": "batch"}, r"logging_interval='batch' is not allowed: expected 'step' or 'epoch'"),
        ({"summary": "yes"}, r"summary='yes' is not allowed: expected True or False"),
        ({"sync_dist": 1}, r"sync_dist=1 is not allowed: expected None, True or False"),
    ],
)
def test_monitor_rejects_bad_arguments(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        CompressionMonitor(**kwargs)


def test_strategy_rejects_bad_compression_monitor() -> None:
    with pytest.raises(ValueError, match=r"compression_monitor='no' is not allowed: expected True or False"):
        SparseDDPStrategy(compression_monitor="no")


def test_monitor_pickles_for_spawn() -> None:
    monitor = pickle.loads(pickle.dumps(CompressionMonitor(logging_interval="epoch")))
    assert monitor.logging_interval == "epoch"


# --------------------------------------------------------------------------- counters and telemetry
def test_unsent_ratio_is_the_unsent_part_over_the_parameters() -> None:
    """Update mode: ||e|| / ||global parameters||, both read where they are; gradient mode has none."""
    from lightning_sparse.exchange.state import SparseState

    named = [("w", torch.nn.Parameter(torch.full((3, 4), 2.0))), ("b", torch.nn.Parameter(torch.zeros(5)))]
    state = SparseState(compress="update")
    assert state.measure_unsent_ratio() is None  # not bound yet
    state.bind(named)
    assert state.measure_unsent_ratio() == 0.0
    state.memory.accumulate("w", torch.full((12,), 0.5))
    state.memory.accumulate("b", torch.ones(5))
    expected = math.sqrt(12 * 0.25 + 5) / math.sqrt(12 * 4.0)
    # float32 norms (one _foreach_norm, one host read), squared and summed in float64
    assert state.measure_unsent_ratio() == pytest.approx(expected, rel=1e-6)
    assert state.telemetry.unsent_ratio == pytest.approx(expected, rel=1e-6)
    gradient = SparseState(compress="gradient")
    gradient.bind(named)
    assert gradient.measure_unsent_ratio() is None


def test_telemetry_keeps_methods_through_state_dict() -> None:
    t = Telemetry()
    t.record(
        "a .. b (2 tensors)",
        Counters(dense_bytes=400, sent_bytes=400, numel=100, sent_numel=100, buckets=1),
        "dense (warm-up)",
    )
    t.end_step()
    start = t.total.copy()
    t.record("a .. b (2 tensors)", Counters(dense_bytes=400, sent_bytes=16, numel=100, sent_numel=2, buckets=1), "topk")
    t.end_step()
    assert (t.total - start).as_dict() == t.last.as_dict()
    clone = Telemetry()
    clone.load_state_dict(t.state_dict())
    assert clone.methods["topk"].sent_bytes == 16 and clone.methods["dense (warm-up)"].sent_bytes == 400
    assert clone.groups["a .. b (2 tensors)"].sent_bytes == 416
    legacy = t.state_dict()
    del legacy["methods"]  # checkpoints written before per-method totals existed
    clone.load_state_dict(legacy)
    assert clone.methods == {} and clone.total.sent_bytes == 416


def test_counters_add_subtract_and_ratios() -> None:
    # one 4-rank step: a top-k bucket all-gathered (3x its 80 bytes through each rank) and a dense
    # bucket all-reduced (1.5x its 400 bytes); a dense all-reduce of both would move 1.5 x 4400
    topk = Counters(dense_bytes=4000, sent_bytes=80, wire_bytes=240.0, dense_wire_bytes=6000.0, buckets=1)
    dense = Counters(dense_bytes=400, sent_bytes=400, wire_bytes=600.0, dense_wire_bytes=600.0, buckets=1)
    total = Counters()
    total.add(topk)
    total.add(dense)
    assert total.wire_bytes == 840.0 and total.dense_wire_bytes == 6600.0 and total.sent_bytes == 480
    assert total.compression_ratio == pytest.approx(6600 / 840)
    assert total.message_ratio == pytest.approx(4400 / 480)
    assert topk.compression_ratio == 25.0 and topk.message_ratio == 50.0
    diff = total - topk
    assert diff.as_dict() == dense.as_dict()
    assert total.copy().as_dict() == total.as_dict()
    # nothing on the wire (world size 1): both ratios are 1 when nothing was sent / moved
    assert Counters(dense_bytes=400, sent_bytes=8).compression_ratio == 1.0
    assert Counters().message_ratio == 1.0


def test_telemetry_loads_totals_written_before_wire_bytes() -> None:
    t = Telemetry()
    t.record("g", Counters(dense_bytes=400, sent_bytes=16, wire_bytes=48.0, dense_wire_bytes=600.0, buckets=1), "topk")
    t.end_step()
    old = t.state_dict()
    for counters in (old["total"], *old["groups"].values(), *old["methods"].values()):
        del counters["wire_bytes"], counters["dense_wire_bytes"]  # a checkpoint of an older version
    clone = Telemetry()
    clone.load_state_dict(old)
    assert clone.total.wire_bytes == 0.0 and clone.total.dense_wire_bytes == 0.0
    assert clone.total.sent_bytes == 16 and clone.methods["topk"].dense_bytes == 400
    assert clone.total.compression_ratio == 1.0 and clone.total.message_ratio == 25.0
    # the run goes on: the traffic ratio covers the steps counted since
    clone.record("g", Counters(dense_bytes=400, sent_bytes=16, wire_bytes=48.0, dense_wire_bytes=600.0), "topk")
    clone.end_step()
    assert clone.total.compression_ratio == 12.5 and clone.total.message_ratio == 25.0
    assert clone.state_dict()["total"]["wire_bytes"] == 48.0


# --------------------------------------------------------------------------- the summary
def _summary() -> CompressionSummary:
    import copy

    t = Telemetry()
    # figures of a 4-rank run: top-k's message is all-gathered (3x its bytes through each rank),
    # dense buckets are all-reduced (2*(4-1)/4 = 1.5x)
    warm = Counters(
        dense_bytes=2_000_000,
        dense_wire_bytes=3_000_000.0,
        wire_bytes=3_000_000.0,
        sent_bytes=2_000_000,
        numel=500_000,
        sent_numel=500_000,
        buckets=2,
        dense_buckets=2,
        compress_seconds=0.001,
    )
    t.record("fc1.weight .. fc1.bias (2 tensors)", warm, "dense (warm-up)")
    t.end_step()
    start = copy.deepcopy(t)
    for _ in range(10):
        t.record(
            "fc1.weight .. fc1.bias (2 tensors)",
            Counters(
                dense_bytes=1_600_000,
                dense_wire_bytes=2_400_000.0,
                wire_bytes=96_000.0,
                sent_bytes=32_000,
                numel=400_000,
                sent_numel=4_000,
                buckets=1,
                compress_seconds=0.002,
            ),
            "topk",
        )
        t.record(
            "fc2.weight",
            Counters(
                dense_bytes=400_000,
                dense_wire_bytes=600_000.0,
                wire_bytes=600_000.0,
                sent_bytes=400_000,
                numel=100_000,
                sent_numel=100_000,
                buckets=1,
                dense_buckets=1,
                fallback_buckets=1,
                compress_seconds=0.0005,
            ),
            "dense (fallback)",
        )
        t.end_step()
    return CompressionSummary.from_telemetry(t, start, step_seconds=0.5, title="fit summary")


def test_summary_as_plain_text_when_not_a_terminal() -> None:
    out = io.StringIO()
    _summary().print(file=out)
    text = out.getvalue()
    assert text.isascii() and text.startswith("fit summary")
    lines = {line.split("  ")[0].strip(): line for line in text.splitlines()}
    # topk over the 10 steps since the snapshot: a dense all-reduce would move 24 MB, the all-gather
    # moved 960 kB (25x); the messages were 50x smaller; 1% dense, 20 ms = 4% of 0.5 s
    for figure in ("10", "24.00 MB", "960.00 kB", "25.0x", "50.0x", "0.0100", "0.020", "4.0%"):
        assert figure in lines["topk"], figure
    for figure in ("6.00 MB", "1.0x", "1.0000", "1.0%"):
        assert figure in lines["dense (fallback)"], figure
    # totals: 30 MB vs 6.96 MB on the wire (4.3x), 20 MB vs 4.32 MB of messages (4.6x); the warm-up
    # step before the snapshot is not counted
    for figure in ("20", "30.00 MB", "6.96 MB", "4.3x", "4.6x", "0.2080", "5.0%"):
        assert figure in lines["all buckets"], figure
    assert "dense (warm-up)" not in text
    assert "fc1.weight .. fc1.bias (2 tensors)" in lines and "fc2.weight" in lines


def test_summary_as_rich_table_on_a_terminal() -> None:
    out = io.StringIO()
    _summary().print(file=out, force_terminal=True, width=80)
    text = out.getvalue()
    assert "\u2500" in text and "\x1b[" in text  # a drawn, styled table
    assert max(len(line) for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()) <= 80
    figures = ("fit summary", "24.00 MB", "960.00 kB", "25.0x", "50.0x", "6.96 MB", "4.3x", "4.6x", "5.0%")
    for figure in (*figures, "fc2.weight", "topk"):
        assert figure in text, figure


def _local_steps_telemetry() -> Telemetry:
    """A 2-rank run with ``sync_every=4``: 1 dense warm-up step, then an exchange every 4 steps; the
    steps between record what dense DDP would have moved with no bucket and nothing sent; an adaptive
    density adds one small collective per exchange."""
    t = Telemetry()
    group = "fc.weight .. fc.bias (2 tensors)"
    step = {"dense_bytes": 400_000, "dense_wire_bytes": 400_000.0, "numel": 100_000}
    warm = {"sent_bytes": 400_000, "wire_bytes": 400_000.0, "sent_numel": 100_000, "buckets": 1, "dense_buckets": 1}
    t.record(group, Counters(**step, **warm), "dense (warm-up)")
    t.end_step()
    sparse = {"sent_bytes": 2_000, "wire_bytes": 2_000.0, "sent_numel": 1_000, "buckets": 1, "compress_seconds": 0.01}
    for i in range(1, 13):
        if i % 4:
            t.record(group, Counters(**step), "local step")
        else:
            t.record(group, Counters(**step, **sparse), "topk")
            t.record("density schedule", Counters(sent_bytes=8, wire_bytes=8.0), "density schedule")
        t.end_step()
    return t


def test_summary_rows_add_up_to_the_total() -> None:
    """Rows without buckets (steps between exchanges, small collectives) are rows too: every section
    adds up to the total, and the table says so."""
    import dataclasses

    t = _local_steps_telemetry()
    summary = CompressionSummary.from_telemetry(t, step_seconds=1.0, title="fit summary")
    assert set(summary.methods) == {"dense (warm-up)", "topk", "local step", "density schedule"}
    for section in (summary.methods, summary.groups):
        for f in dataclasses.fields(Counters):
            added = sum(getattr(c, f.name) for c in section.values())
            assert added == pytest.approx(getattr(summary.total, f.name)), f.name
    text = summary.to_text()
    rows = {re.split(r"\s{2,}", line)[0]: re.split(r"\s{2,}", line)[1:] for line in text.splitlines()}
    # 9 steps between exchanges: 3.6 MB a dense all-reduce would have moved, nothing on the wire, no ratio
    assert rows["not sent (local steps)"] == ["0", "3.60 MB", "0 B", "-", "-", "0.0000", "0.000", "0.0%"]
    assert rows["topk"][:5] == ["3", "1.20 MB", "6.00 kB", "200.0x", "200.0x"]
    # a small collective of its own: bytes on the wire, no dense counterpart, no coordinates
    assert rows["density schedule"][:6] == ["0", "0 B", "24 B", "-", "-", "-"]
    assert rows["all buckets"][:3] == ["4", "5.20 MB", "406.02 kB"]
    assert text.splitlines()[-1] == ADDS_UP and "not per step" in ADDS_UP
    rich = io.StringIO()
    summary.print(file=rich, force_terminal=True, width=200)
    assert "not sent (local steps)" in rich.getvalue() and "add up to the total row" in rich.getvalue()


#: for every setting the header does not always name, keyword arguments of SparseConfig that change it
_CHANGED_SETTINGS: dict[str, dict[str, Any]] = {
    "error_feedback": {"error_feedback": False},
    "min_numel": {"min_numel": 256},
    "warmup_steps": {"warmup_steps": 0},
    "value_dtype": {"value_dtype": "bfloat16"},
    "seed": {"seed": 7},
    "batchnorm_batches": {"batchnorm_batches": 0},
    "batchnorm_warmup": {"batchnorm_warmup": 0},
    "error_feedback_decay": {"error_feedback_decay": 0.95},
    "flush_at_end": {"flush_at_end": False},
    "max_nonfinite_steps": {"max_nonfinite_steps": 3},
    "offload_global": {"offload_global": True},
    "sync_delay": {"sync_every": 4, "sync_delay": 1},
    "fragments": {"sync_every": 4, "fragments": 2},
    "fragment_split": {"sync_every": 4, "fragments": 2, "fragment_split": "contiguous"},
    "offload_residual": {"offload_residual": True},
    "fault_tolerant": {"fault_tolerant": True},
    "min_replicas": {"min_replicas": 2},
    "quorum_timeout": {"quorum_timeout": 30.0},
    "fallback_to_dense": {"fallback_to_dense": "time"},
    "momentum_correction": {"compress": "gradient", "momentum_correction": 0.9},
    "exchange": {"exchange": "split"},
    "compact_indices": {"compact_indices": False},
    "sync_every": {"sync_every": 4},
    "outer_optimizer": {"outer_optimizer": "nesterov"},
    "outer_momentum": {"outer_optimizer": "nesterov", "outer_momentum": 0.8},
    "value_bits": {"value_bits": 2},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": False},
    "bucket_cap_mb": {"bucket_cap_mb": 10.0},
    "start_method": {"start_method": "spawn"},
}


def test_summary_header_names_every_setting_that_differs_from_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    from _dist import FT

    from lightning_sparse.config import SparseConfig, setting_names
    from lightning_sparse.exchange.fallback import TimedFallback
    from lightning_sparse.telemetry.summary import changed_settings, fit_title

    # the mode, the compressor and the density are always named; every other setting is covered here
    assert set(_CHANGED_SETTINGS) == set(setting_names()) - {"compress", "compressor", "density"}
    default = "Sparse update communication: TopK(fast=True), ConstantDensity(density=0.01); 110 steps, rank 0 of 2"
    assert fit_title(SparseConfig(), 110, 0, 2) == default
    assert fit_title(SparseConfig(seed=0, min_numel=1024, value_dtype=None, sync_every=1), 110, 0, 2) == default
    env = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510", "REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "2"}
    for key, value in env.items():  # fault_tolerant=True reads them at construction
        monkeypatch.setenv(key, value)
    for name, kwargs in _CHANGED_SETTINGS.items():
        if name == "fault_tolerant" and not FT:
            continue  # it needs the optional package, and a torch that runs it
        config = SparseConfig(**kwargs)
        # what the setting needs
        also = [n for n in ("sync_every", "fragments", "outer_optimizer") if n in kwargs and n != name]
        assert list(changed_settings(config)) == [*also, name], name
        assert f"{name}=" in fit_title(config, 5, 0, 2).split("; ")[1], name
    config = SparseConfig(sync_every=4, value_bits=2, outer_optimizer="nesterov", compressor="rtopk", density=0.001)
    assert fit_title(config, 44, 1, 4) == (
        "Sparse update communication: RTopK(r_factor=4.0), ConstantDensity(density=0.001); "
        "sync_every=4, outer_optimizer='nesterov', value_bits=2; 44 steps, rank 1 of 4"
    )
    # values as they were given, objects by their repr, optimizer factories by their import path
    assert changed_settings(SparseConfig(value_dtype="bfloat16")) == {"value_dtype": "torch.bfloat16"}
    assert changed_settings(SparseConfig(fallback_to_dense=TimedFallback(trial_steps=3))) == {
        "fallback_to_dense": repr(TimedFallback(trial_steps=3))
    }
    outer = functools.partial(torch.optim.SGD, lr=0.5)
    assert changed_settings(SparseConfig(outer_optimizer=outer)) == {"outer_optimizer": "torch.optim.sgd.SGD(lr=0.5)"}
    assert changed_settings(SparseConfig(compress="gradient")) == {}  # the mode is in the title's first words


def test_format_bytes() -> None:
    assert format_bytes(999) == "999 B"
    assert format_bytes(1000) == "1.00 kB"
    assert format_bytes(11_497_000) == "11.50 MB"
    assert format_bytes(3.2e12) == "3.20 TB"


# --------------------------------------------------------------------------- torchmetrics
def _metrics_worker(rank: int, world: int) -> dict[str, float]:
    from lightning_sparse.telemetry.metrics import (
        BytesSent,
        CompressionRatio,
        CompressTime,
        Density,
        MessageRatio,
        ResidualNorm,
        WireBytes,
    )

    ratio, density, sent, ctime, norm = CompressionRatio(), Density(), BytesSent(), CompressTime(), ResidualNorm()
    message, wire = MessageRatio(), WireBytes()
    for step in range(3):
        c = Counters(
            dense_bytes=1000 * (rank + 1),
            dense_wire_bytes=1500.0 * (rank + 1),
            wire_bytes=30.0 * (rank + 1) + 3 * step,
            sent_bytes=10 * (rank + 1) + step,
            numel=250 * (rank + 1),
            sent_numel=5 * (rank + 1),
            compress_seconds=0.001 * (rank + 1),
        )
        for m in (ratio, density, message):
            m.update(c)
        sent.update(c, steps=1)
        wire.update(c, steps=1)
        ctime.update(c, steps=1)
        norm.update(3.0 + step if rank == 0 else 4.0)
    return {
        "ratio": float(ratio.compute()),
        "message": float(message.compute()),
        "wire": float(wire.compute()),
        "density": float(density.compute()),
        "sent": float(sent.compute()),
        "ctime": float(ctime.compute()),
        "norm": float(norm.compute()),
    }


@pytest.mark.dist
def test_metrics_synchronise_across_ranks(dist2) -> None:
    results = dist2.run(_metrics_worker)
    assert results[0] == results[1]
    r = results[0]
    # rank 0: 3000 dense, 30+3 sent; rank 1: 6000 dense, 60+3 sent; on the wire 1.5x and 3x those
    assert r["ratio"] == pytest.approx(13500 / 288)
    assert r["message"] == pytest.approx(9000 / 96)
    assert r["wire"] == pytest.approx(288 / 6)
    assert r["density"] == pytest.approx((15 + 30) / (750 + 1500))
    assert r["sent"] == pytest.approx(96 / 6)
    assert r["ctime"] == pytest.approx(1000 * 0.009 / 6)
    assert r["norm"] == pytest.approx(math.sqrt(5.0**2 + 4.0**2))  # the latest norm of each rank


def test_metric_arguments_are_checked() -> None:
    from lightning_sparse.telemetry.metrics import BytesSent, ResidualNorm

    with pytest.raises(ValueError, match=r"steps=0 is not allowed"):
        BytesSent().update(Counters(), steps=0)
    with pytest.raises(ValueError, match=r"norm=nan is not allowed"):
        ResidualNorm().update(float("nan"))


def test_bytes_inside_a_group_are_reported_apart() -> None:
    from lightning_sparse.strategies.monitor import compression_figures

    t = Telemetry()
    t.record("fc.weight", Counters(dense_bytes=4000, sent_bytes=80, buckets=1), method="topk")
    t.end_step()
    assert t.group_bytes is None
    assert "Inside this process's group" not in CompressionSummary.from_telemetry(t).to_text()
    assert "sparse/group_bytes" not in compression_figures(t.total, 1, t.total, 0.0)
    start = Telemetry(group_bytes=1000.0)
    t.record_group(1500.0)
    t.record_group(1500.0)
    assert t.group_bytes == 3000.0
    text = CompressionSummary.from_telemetry(t, start=start).to_text()
    assert f"reduce-scatters, not in the table): {format_bytes(2000.0)} moved" in text
    assert compression_figures(t.total, 2, t.total, 0.0, None, 3000.0)["sparse/group_bytes"] == 1500.0
    restored = Telemetry()
    restored.load_state_dict(t.state_dict())
    assert restored.group_bytes == 3000.0
