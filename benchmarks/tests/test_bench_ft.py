"""``python -m benchmarks ft``: three replica groups, killed and restarted in turn, against the fit without failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sparse._utils import TORCH_FOR_FT, torch_at_least

pytest.importorskip("torchft")
if not torch_at_least(TORCH_FOR_FT):
    pytest.skip(f"fault_tolerant=True needs torch >= {TORCH_FOR_FT}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
@pytest.mark.slow
def test_ft_bench_reports_what_a_failure_costs(tmp_path: Path) -> None:
    out = tmp_path / "ft.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks", "ft", "--steps", "360", "--kills", "0.15,0.6", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [k["group"] for k in figures["kills"]] == [2, 0] and figures["identical_global_models"]
    assert figures["heals"][2] >= 1 and figures["heals"][0] >= 1  # each restarted group healed
    assert all(0 < s < 120 for s in figures["kill_to_first_commit_s"])  # and rejoined
    assert figures["survivor_rate_ratio"] > 0.5  # the survivors went on while a group was down
    assert abs(figures["val_loss_faulty"][0] - figures["val_loss_clean"][0]) < 0.05
