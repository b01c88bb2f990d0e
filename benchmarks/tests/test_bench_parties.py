"""The parties benchmark on CPUs with a tiny GPT (the figures are read, their values not asserted
beyond what must hold in any run)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.parties import format_table
from lightning_sparse.demos.gpt import TinyGPT


@pytest.mark.dist
def test_parties_bench_runs_dense_and_sparse_rows(tmp_path: Path) -> None:
    out = tmp_path / "parties.json"
    cmd = [sys.executable, "-m", "benchmarks", "parties", "--parties", "2", "--samples", "320", "--width", "32",
           "--layers", "1", "--variants", 'outer2={"outer_lr": 2.0}', 'diloco={"diloco": 4}', "--timeout", "300",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["parties"]["2"]
    params = sum(p.numel() for p in TinyGPT(context=32, width=32, layers=1, heads=4).parameters())
    assert list(rows) == ["dense", "default", "every4", "outer2", "diloco"]
    assert all(r["steps"] == 10 for r in rows.values())  # 320 windows, batch 16, 2 processes
    for name, r in rows.items():
        assert math.isfinite(r["val_loss"]) and math.isfinite(r["virtual_loss"]), name
        if name == "dense":  # every step's float32 gradient
            assert r["virtual_loss"] == r["val_loss"] and math.isnan(r["resid"]) and r["bytes"] == 10 * 4 * params
        elif name == "diloco":  # torchft's DiLoCo: outer steps after steps 4 and 8, each all-reducing the
            # whole model's pseudo-gradients in float32
            assert r["bytes"] == 2 * 4 * params and r["virtual_loss"] == r["val_loss"]
        else:  # residuals kept, views apart, and of the moved coordinates a share sent by one party
            assert 0 < r["bytes"] < rows["dense"]["bytes"], (name, r["bytes"])  # fewer than DDP hands over
            assert r["resid"] > 0 and r["apart"] > 0 and 0 <= r["one"] <= 1, (name, r)
    assert "| outer2 |" in format_table(result, 2) and "| dense | " in proc.stdout


@pytest.mark.dist
def test_parties_bench_runs_the_text_task(tmp_path: Path) -> None:
    out = tmp_path / "text.json"
    cmd = [sys.executable, "-m", "benchmarks", "parties", "--task", "text", "--parties", "2", "--samples", "1280",
           "--only", "default", "--timeout", "300", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["parties"]["2"]
    assert result["task"] == "text" and list(rows) == ["dense", "default"]
    assert all(r["steps"] == 10 for r in rows.values())  # 1280 windows, batch 64, 2 processes
    assert math.isfinite(rows["default"]["val_loss"]) and rows["default"]["resid"] > 0
    assert math.isnan(rows["dense"]["v"])  # SGD keeps no second moment
    assert "text: 2 parties, 10 steps each" in proc.stdout
