"""The lag probe runs a 2-process fit of the vision task and writes what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
@pytest.mark.parametrize(
    "shape",
    [pytest.param([], marks=pytest.mark.slow), ["--submodule", "--hand-over"]],
    ids=["self", "submodule handed over"],
)
def test_lag_probe_measures_a_tiny_fit(tmp_path: Path, shape: list[str]) -> None:
    out = tmp_path / "lag.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.lag_probe", "--out", str(out), "--width", "4", "--steps", "6"]
    proc = subprocess.run(
        [*cmd, "--sync-every", "2", *shape], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["bn_identical_across_ranks"] is True
    # validation (each process its share, averaged) and the checkpoint (rank 0, every image) agree
    assert result["validate_acc"] == pytest.approx(result["checkpoint_acc"], abs=0.05)
    if "--hand-over" in shape:  # the global model holds every process's progress: no lag left
        assert result["unsent_norm"] == 0
    else:
        assert 0 < result["unsent_norm"] < result["param_norm"]
    assert all(0 <= v["unsent_over_param"] for v in result["per_tensor"].values())
