"""The step benchmark's code paths on tiny sizes (figures are not asserted: machines are noisy)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks._ranks import CHECKOUT, checkout_env
from benchmarks.step import (
    DENSE,
    ShapedLink,
    add_arguments,
    describe_link,
    failed_row,
    failure_reason,
    format_old_new,
    format_table,
    model_shape,
    old_new_rows,
    parse_latency,
    parse_params,
    parse_rate,
    run,
)


@pytest.mark.parametrize(
    "text, bits",
    [("1gbit", 1e9), ("100mbit", 1e8), ("10Gbit", 1e10), ("2.5gbit", 2.5e9), ("500kbit", 5e5), ("1mbps", 8e6)],
)
def test_parse_rate(text: str, bits: float) -> None:
    assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["none", "unshaped", "0"])
def test_parse_rate_none_is_unshaped(text: str) -> None:
    assert parse_rate(text) is None


@pytest.mark.parametrize("text", ["fast", "1gb", "-1gbit", "0gbit", ""])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="--bandwidth"):
        parse_rate(text)


def test_parse_latency_and_params() -> None:
    assert parse_latency("1ms") == pytest.approx(1e-3)
    assert parse_latency("500us") == pytest.approx(5e-4)
    assert parse_latency("0") == 0.0
    assert parse_params("25e6") == 25_000_000
    with pytest.raises(ValueError, match="--latency"):
        parse_latency("soon")
    with pytest.raises(ValueError, match="--params"):
        parse_params("100")
    with pytest.raises(ValueError, match="--params"):
        parse_params("many")


def test_model_shape_holds_about_the_parameters() -> None:
    width = model_shape(25_000_000, 6)
    assert abs(6 * width * width - 25_000_000) / 25_000_000 < 0.01


def test_table_ratios_against_dense() -> None:
    result = {
        "world_size": 2, "link": describe_link(1e9, 0.0), "layers": 2, "width": 10, "params": 220, "batch_size": 4,
        "threads": 1, "density": 0.01, "steps": 3, "warmup": 2, "torch": "x",
        "runs": [
            {"name": DENSE, "median_s": 2.0, "bytes_per_step": 880.0, "compression_ratio": None, "hook_ms": None,
             "buckets": None, "dense_buckets": None},
            {"name": "sparse_ddp topk", "median_s": 0.5, "bytes_per_step": 88.0, "compression_ratio": 10.0,
             "hook_ms": 1.5, "buckets": 6, "dense_buckets": 0},
            # local steps: the median is a step without an exchange, the ratio is of the means
            {"name": "every 4", "median_s": 0.4, "mean_s": 1.0, "bytes_per_step": 8.0, "compression_ratio": 110.0,
             "hook_ms": 1.0, "buckets": 6, "dense_buckets": 0, "peak_step_wire_bytes": 3.2e6},
        ],
    }  # fmt: skip
    table = format_table(result)
    assert "1 Gbit/s" in table
    assert "| sparse_ddp topk | 0.500 | 0.500 | 4.00x |" in table  # figures saved before means: the median
    assert "| dense DDP | 2.000 | 2.000 | 1.00x |" in table
    assert "| every 4 | 0.400 | 1.000 | 2.00x | 0.00 | - | 3.20 | 110.0x |" in table


def test_table_shows_a_failed_peer() -> None:
    result = {
        "world_size": 2, "link": describe_link(None, 0.0), "layers": 2, "width": 10, "params": 220, "batch_size": 4,
        "threads": 1, "density": 0.01, "steps": 3, "warmup": 2, "torch": "x",
        "runs": [
            {"name": DENSE, "median_s": 2.0, "bytes_per_step": 880.0, "compression_ratio": None, "hook_ms": None,
             "buckets": None, "dense_buckets": None, "status": "ok"},
            failed_row("bf16 (torch hook)", "RuntimeError: no bf16 here"),
        ],
    }  # fmt: skip
    table = format_table(result)
    assert "| dense DDP | 2.000 | 2.000 | 1.00x | 0.00 | - | - | - | - | - | ok |" in table  # no wire bytes yet
    assert "| bf16 (torch hook) | - | - | - | - | - | - | - | - | - | failed: RuntimeError: no bf16 here |" in table


def test_failure_reason_prefers_the_rank_that_failed_first() -> None:
    knock_on = "Traceback (most recent call last):\n  ...\nRuntimeError: [gloo] Connection closed by peer [::1]:1\n"
    cause = "Traceback (most recent call last):\n  ...\nValueError: bf16 is not supported here\nmore context\n"
    assert failure_reason([knock_on, cause], [1, 1]) == "ValueError: bf16 is not supported here"
    assert failure_reason([knock_on], [1]).startswith("RuntimeError: [gloo] Connection closed")
    assert failure_reason(["terminate called after throwing\n"], [-6]) == "terminate called after throwing"
    assert failure_reason([""], [-9]) == "exit codes [-9]"
    assert failure_reason(["[rank1]: TypeError: BF16 all reduce\n"], [1]) == "TypeError: BF16 all reduce"
    assert failure_reason(["torch.distributed.DistBackendError: " + "x" * 300], [1], limit=50).endswith("...")


def _run_bench(tmp_path, *extra: str) -> dict:
    out = tmp_path / "step.json"
    cmd = [
        sys.executable, "-m", "benchmarks", "step", "--params", "2e4", "--layers", "2", "--steps", "2",
        "--warmup", "2", "--batch-size", "4", "--threads", "1", "--compressors", "topk", "randomk",
        "--timeout", "240", "--json", str(out), *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| dense DDP |" in done.stdout and "| sparse_ddp topk (update) |" in done.stdout
    return json.loads(out.read_text())


#: every sparse run of _run_bench: each compressor in each mode
SPARSE_RUNS = [f"sparse_ddp {c} ({m})" for m in ("update", "gradient") for c in ("topk", "randomk")]


def _check(result: dict) -> None:
    runs = {r["name"]: r for r in result["runs"]}
    assert set(runs) == {DENSE, *SPARSE_RUNS}
    dense = runs[DENSE]
    assert dense["bytes_per_step"] == result["params"] * 4
    for name in SPARSE_RUNS:
        run = runs[name]
        assert len(run["times_s"]) == 2 and all(t > 0 for t in run["times_s"])
        # 1% of each 100x100 weight goes sparse, the biases dense: far fewer bytes than dense
        assert 0 < run["bytes_per_step"] < dense["bytes_per_step"] / 5
        assert run["compression_ratio"] == pytest.approx(dense["bytes_per_step"] / run["bytes_per_step"])
        assert run["dense_buckets"] == 0  # the timed steps come after the dense warm-up step
        # the package's collectives: one bucket per step, a collective or two each
        assert 1 <= run["collectives_per_step"] <= 2 and run["collectives"] == 2 * run["collectives_per_step"]
    assert dense["collectives"] is None  # DDP's own all-reduces do not go through the package


@pytest.mark.dist
def test_step_bench_unshaped(tmp_path) -> None:
    result = _run_bench(tmp_path, "--bandwidth", "none")
    assert result["link"] == "unshaped loopback" and result["bandwidth_bits"] is None
    _check(result)


@pytest.mark.dist
@pytest.mark.skipif(ShapedLink.unavailable() is not None, reason="needs root and iproute2 (ip, tc)")
def test_step_bench_shaped(tmp_path) -> None:
    result = _run_bench(tmp_path, "--bandwidth", "100mbit")
    assert result["bandwidth_bits"] == pytest.approx(1e8) and result["latency_s"] == 0
    assert "100 Mbit/s" in result["link"]
    _check(result)


@pytest.mark.slow
@pytest.mark.dist
def test_step_bench_exchanges_on_4_ranks(tmp_path) -> None:
    """`--world-size 4 --exchanges allgather split`: a row per exchange for top-k, one for random-k
    (its values are all-reduced: the exchange does not apply); wire bytes on every row."""
    out = tmp_path / "step.json"
    cmd = [
        sys.executable, "-m", "benchmarks", "step", "--bandwidth", "none", "--world-size", "4",
        "--params", "2e4", "--layers", "2", "--steps", "2", "--warmup", "2", "--batch-size", "4", "--threads", "1",
        "--compressors", "topk", "randomk", "--modes", "update", "--exchanges", "allgather", "split",
        "--timeout", "240", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {r["name"]: r for r in result["runs"]}
    names = ["sparse_ddp topk (update, allgather)", "sparse_ddp topk (update, split)", "sparse_ddp randomk (update)"]
    assert set(runs) == {DENSE, *names} and result["world_size"] == 4
    dense = runs[DENSE]
    assert dense["wire_bytes_per_step"] == pytest.approx(1.5 * dense["bytes_per_step"])  # 2 (W-1)/W at 4 ranks
    for name in names:
        assert runs[name]["status"] == "ok" and len(runs[name]["times_s"]) == 2
        assert 0 < runs[name]["wire_bytes_per_step"] < dense["wire_bytes_per_step"]
    assert "| MB on the wire per rank per step |" in done.stdout


@pytest.mark.slow
@pytest.mark.dist
def test_step_bench_timed_fallback(tmp_path) -> None:
    result = _run_bench(tmp_path, "--bandwidth", "none", "--fallback", "time")
    assert result["fallback"] == "time"
    assert result["warmup"] == 12  # raised past the trial: warm-up step, 5 + 5 trial steps, the choice
    for name in SPARSE_RUNS:
        run = next(r for r in result["runs"] if r["name"] == name)
        (decision,) = run["timed_fallback"]
        assert decision["step"] == 11 and decision["choice"] in ("sparse", "dense")
        # every timed step went the chosen way
        assert run["dense_buckets"] == (run["buckets"] if decision["choice"] == "dense" else 0)
    assert "timed fallback (median exchange window" in format_table(result)


@pytest.mark.dist
def test_step_bench_rejects_bad_fallback(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "step", "--fallback", "fast"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--fallback: invalid choice: 'fast'" in done.stderr


def _run_peers(tmp_path, *peers: str) -> tuple[dict, str]:
    out = tmp_path / "peers.json"
    cmd = [
        sys.executable, "-m", "benchmarks", "step", "--bandwidth", "none", "--params", "2e5",
        "--steps", "3", "--threads", "1", "--compressors", "topk", "--modes", "update", "--peers", *peers,
        "--probe-timeout", "240", "--timeout", "300", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.mark.slow
@pytest.mark.dist
def test_step_bench_peers(tmp_path) -> None:
    result, table = _run_peers(tmp_path, "powersgd:2", "fp16")
    assert result["peers"] == ["powersgd:2", "fp16"]
    runs = {r["name"]: r for r in result["runs"]}
    assert set(runs) == {DENSE, "sparse_ddp topk (update)", "PowerSGD rank 2 (torch hook)", "fp16 (torch hook)"}
    dense = runs[DENSE]["bytes_per_step"]
    fp16 = runs["fp16 (torch hook)"]
    assert fp16["status"] == "ok" and len(fp16["times_s"]) == 3
    assert fp16["bytes_per_step"] == dense / 2  # every gradient all-reduced once, in 2 bytes
    assert fp16["compression_ratio"] == pytest.approx(2.0)
    assert "| PowerSGD rank 2 (torch hook) |" in table and "| fp16 (torch hook) |" in table
    powersgd = runs["PowerSGD rank 2 (torch hook)"]
    # torch's PowerSGD hook issues collectives from gloo's threads and now and then hangs on CPU even
    # here (one bucket); the benchmark then reports it, which is what it is for
    if powersgd["status"] != "ok":
        assert powersgd["status"].startswith("failed: ") and powersgd["median_s"] is None
        return
    assert len(powersgd["times_s"]) == 3
    assert 0 < powersgd["bytes_per_step"] < dense / 5  # rank-2 factors of 182x182 weights, biases dense


@pytest.mark.slow
@pytest.mark.dist
def test_step_bench_failing_peer_is_a_row(tmp_path) -> None:
    # torch's bf16 hook refuses to register without CUDA + NCCL (or XPU + XCCL): on a CPU build of
    # torch the peer fails its probe, and the benchmark reports it and times the other runs.
    result, table = _run_peers(tmp_path, "bf16")
    runs = {r["name"]: r for r in result["runs"]}
    assert runs[DENSE]["status"] == "ok" and len(runs["sparse_ddp topk (update)"]["times_s"]) == 3
    bf16 = runs["bf16 (torch hook)"]
    if torch.version.cuda is None and torch.version.hip is None:
        assert bf16["status"].startswith("failed: TypeError: BF16 all reduce communication hook required")
        assert bf16["median_s"] is None
        assert "| bf16 (torch hook) | - | - | - | - | - | - | - | - | - | failed: TypeError: BF16" in table
    else:  # a CUDA build registers it: gloo then all-reduces bfloat16 on CPU
        assert bf16["status"] == "ok" or bf16["status"].startswith("failed: ")


def test_table_compares_each_run_with_its_unshaped_self() -> None:
    result = {
        "world_size": 2, "link": describe_link(1e7, 0.0), "layers": 2, "width": 10, "params": 220, "batch_size": 4,
        "threads": 1, "density": 0.01, "steps": 8, "warmup": 2, "torch": "x",
        "runs": [
            {"name": DENSE, "median_s": 2.0, "mean_s": 2.0, "unshaped_mean_s": 0.5, "bytes_per_step": 880.0,
             "compression_ratio": None, "hook_ms": None, "buckets": None, "dense_buckets": None},
            {"name": "delay 1", "median_s": 0.4, "mean_s": 0.525, "unshaped_mean_s": 0.5, "bytes_per_step": 8.0,
             "compression_ratio": 110.0, "hook_ms": 1.0, "buckets": 6, "dense_buckets": 0},
        ],
    }  # fmt: skip
    table = format_table(result)
    assert "| dense DDP | 2.000 | 0.500 | 4.00x | 4.00x | 1.00x |" in table
    assert "| delay 1 | 0.525 | 0.500 | 1.05x | 1.05x | 1.00x |" in table
    # dense DDP on the unshaped loopback only: the floor comes from there
    result["runs"] = result["runs"][1:]
    result["unshaped_dense_mean_s"] = 0.25
    table = format_table(result)
    assert "| delay 1 | 0.525 | 0.500 | 1.05x | 2.10x | 0.50x |" in table
    assert "(unshaped dense DDP, the compute floor: 0.250 s)" in table


def test_old_new_table_takes_the_median_over_launches() -> None:
    setup = {
        "world_size": 2, "link": describe_link(1e9, 0.0), "layers": 2, "width": 10, "params": 220, "batch_size": 4,
        "threads": 1, "density": 0.01, "steps": 3, "warmup": 2, "torch": "x",
    }  # fmt: skip

    def launch(topk_s: float | None, dense_s: float = 1.0) -> dict:
        return {**setup, "runs": [
            {"name": DENSE, "median_s": dense_s, "bytes_per_step": 880.0},
            {"name": "sparse_ddp topk (update)", "median_s": topk_s, "bytes_per_step": 88e4 if topk_s else None},
        ]}  # fmt: skip

    old = [launch(0.5), launch(0.7), launch(0.6, dense_s=3.0)]
    new = [launch(0.3), launch(0.4), launch(0.2)]
    dense, topk = old_new_rows(old, new)
    assert (dense["old_s"], dense["new_s"], dense["new_over_old"]) == (1.0, 1.0, 1.0)
    assert topk["old_launches_s"] == [0.5, 0.7, 0.6] and topk["old_s"] == 0.6 and topk["new_s"] == 0.3
    assert topk["new_over_old"] == pytest.approx(0.5)
    table = format_old_new("0123456789abcdef", old, new)
    assert "package at 0123456 (old) and the working tree's (new), 3 launches of each" in table
    assert (
        "| sparse_ddp topk (update) | 0.600 | 0.300 | 0.50 | 0.88 | 0.88 | 0.500, 0.700, 0.600; 0.300, 0.400, 0.200 |"
        in table
    )
    # a run that could not be timed under the old code
    table = format_old_new("0123456", [launch(None)], [launch(0.2)])
    assert "| sparse_ddp topk (update) | - | 0.200 | - | - | 0.88 | -; 0.200 |" in table


def test_checkout_env_puts_another_package_first(tmp_path: Path) -> None:
    env = checkout_env({"PYTHONPATH": "/elsewhere"}, tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), str(CHECKOUT), "/elsewhere"]


def test_rev_refuses_the_peers() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--rev is not allowed with --peers"):
        run(parser.parse_args(["--rev", "HEAD", "--peers", "fp16"]))
    with pytest.raises(ValueError, match="--rounds=0 is not allowed"):
        run(parser.parse_args(["--rev", "HEAD", "--rounds", "0"]))


@pytest.mark.slow
@pytest.mark.dist
def test_step_bench_delay_and_fragments_against_unshaped(tmp_path) -> None:
    """`--sync-delay 0 1 --fragments 1 4 --unshaped-baseline` (shaped where this machine can): a row
    per setting, each with its mean step over whole cycles, its peak bytes of one step's exchange
    (4 fragments of 4 equal matrices: a quarter) and, on a shaped link, its unshaped mean step."""
    out = tmp_path / "step.json"
    cmd = [
        sys.executable, "-m", "benchmarks", "step", "--bandwidth", "100mbit", "--unshaped-baseline",
        "--params", "4e5", "--layers", "4", "--steps", "8", "--warmup", "4", "--batch-size", "4", "--threads", "1",
        "--compressors", "topk", "--modes", "update", "--sync-every", "4", "--sync-delay", "0", "1",
        "--fragments", "1", "4", "--value-bits", "2", "--warmup-exchanges", "0", "--timeout", "240",
        "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {r["name"]: r for r in result["runs"]}
    base = "sparse_ddp topk (update, every 4 steps, 2-bit values"
    names = [base + ")", base + ", 4 fragments)", base + ", delay 1)", base + ", 4 fragments, delay 1)"]
    assert set(names) <= set(runs), sorted(runs)
    for name in names:
        r = runs[name]
        assert len(r["times_s"]) == 8 and r["mean_s"] == pytest.approx(sum(r["times_s"]) / 8)
        assert r["wait_s_per_step"] >= 0.0
    # the same exchanges, whenever they are applied; a quarter of the model in each fragment's exchange
    assert runs[names[2]]["bytes_per_step"] == runs[names[0]]["bytes_per_step"]
    for whole, part in ((names[0], names[1]), (names[2], names[3])):
        assert runs[part]["peak_step_wire_bytes"] <= 0.3 * runs[whole]["peak_step_wire_bytes"]
    if ShapedLink.unavailable() is None:
        assert all(runs[n]["unshaped_mean_s"] > 0 for n in names)
        assert DENSE not in runs and result["unshaped_dense_mean_s"] > 0  # dense DDP runs unshaped only
        assert "the compute floor" in done.stdout
