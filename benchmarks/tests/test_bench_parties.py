"""The parties benchmark on CPUs with a tiny GPT (the figures are read, their values not asserted
beyond what must hold in any run)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.parties import format_table
from lightning_sparse._utils import TORCH_FOR_FT, torch_at_least
from lightning_sparse.demos.gpt import TinyGPT


@pytest.mark.dist
def test_parties_bench_runs_dense_and_sparse_rows(tmp_path: Path) -> None:
    out = tmp_path / "parties.json"
    # its row where torchft is installed and this torch runs it (2.8 and newer)
    diloco = importlib.util.find_spec("torchft") is not None and torch_at_least(TORCH_FOR_FT)
    cmd = [sys.executable, "-m", "benchmarks", "parties", "--parties", "2", "--samples", "320", "--width", "32",
           "--layers", "1", "--variants", 'outer2={"outer_lr": 2.0}', *(['diloco={"diloco": 4}'] * diloco),
           "--timeout", "300", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["parties"]["2"]
    params = sum(p.numel() for p in TinyGPT(context=32, width=32, layers=1, heads=4).parameters())
    assert list(rows) == ["dense", "default", "every4", "outer2", *(["diloco"] * diloco)]
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


@pytest.mark.slow
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


def test_the_noise_correction_scales_each_step_by_the_averaged_second_moment() -> None:
    """With one party the step is AdamW's own, bit for bit; with N each coordinate's step is AdamW's
    times sqrt(v / v'), v' = m^2 + (v - m^2) / N, between 1 and sqrt(N)."""
    import torch

    from benchmarks.parties import _noise_correct

    def steps(parties: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.optim.AdamW]:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64))
        opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
        if parties is not None:
            _noise_correct(opt, parties)
        for _ in range(3):
            before = p.detach().clone()
            p.grad = torch.randn(64)
            opt.step()
        return before, p.detach().clone(), opt

    before, plain, _ = steps(None)
    _, one, _ = steps(1.0)
    assert torch.equal(one, plain)  # one party: nothing to correct
    b4, four, opt = steps(4.0)
    (state,) = opt.state.values()
    m = state["exp_avg"] / (1 - 0.9**3)
    v = state["exp_avg_sq"] / (1 - 0.95**3)
    f = (v / (m * m + (v - m * m) / 4)).sqrt().clamp(1.0, 2.0)
    assert torch.allclose(four - b4, f * (plain - before), rtol=1e-5, atol=1e-7)
    assert bool((f > 1.0).any()) and bool((f <= 2.0).all())


@pytest.mark.slow
@pytest.mark.dist
def test_parties_bench_runs_uncompressed_corrected_and_gradient_rows(tmp_path: Path) -> None:
    out = tmp_path / "full.json"
    cmd = [sys.executable, "-m", "benchmarks", "parties", "--parties", "2", "--samples", "320", "--width", "32",
           "--layers", "1", "--variants", 'full={"density": 1.0}', 'nf={"density": 1.0, "noise_correct": true}',
           'grad={"compress": "gradient"}', 'noclip={"density": 1.0, "clip": 0}', "--only", "full", "nf", "grad",
           "noclip", "--timeout", "300",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["parties"]["2"]
    assert list(rows) == ["dense", "full", "nf", "grad", "noclip"]
    assert rows["noclip"]["val_loss"] != rows["full"]["val_loss"]  # clipping at 1 changed the steps
    assert rows["full"]["resid"] == 0 and rows["nf"]["resid"] == 0  # density 1: nothing left behind
    assert rows["nf"]["val_loss"] != rows["full"]["val_loss"]  # the correction changed the steps
    assert math.isnan(rows["grad"]["resid"]) and 0 < rows["grad"]["bytes"] < rows["dense"]["bytes"]


def test_the_local_clip_estimate_clips_less_the_more_of_the_gradient_is_noise() -> None:
    """Without AdamW moments it clips as ``clip_grad_norm_`` does; where the moments say the gradient
    is noise, the averaged gradient's norm is taken as smaller (down to ``1/sqrt(N)`` of the party's)."""
    import torch

    from benchmarks.parties import _clip_by_average

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(64))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95))
    grad = torch.randn(64) * 3
    p.grad = grad.clone()
    _clip_by_average([p], opt, 1.0, 4, "local")  # no moments yet: the party's own norm
    assert torch.allclose(p.grad, grad / grad.norm(), rtol=1e-5)
    opt.state[p] = {"step": torch.tensor(100.0), "exp_avg": torch.zeros(64), "exp_avg_sq": torch.ones(64)}
    p.grad = grad.clone()
    _clip_by_average([p], opt, 1.0, 4, "local")  # all noise: the average's norm is half the party's
    assert torch.allclose(p.grad.norm(), torch.tensor(2.0), rtol=1e-4)


@pytest.mark.slow
@pytest.mark.dist
def test_parties_bench_runs_the_probes_and_the_plain_average(tmp_path: Path) -> None:
    """At 2 parties the default outer step is the plain average, bit for bit; the clipping and view
    probes change the fit."""
    out = tmp_path / "probes.json"
    cmd = [sys.executable, "-m", "benchmarks", "parties", "--parties", "2", "--samples", "320", "--width", "32",
           "--layers", "1", "--variants", 'plain={"chosen_scale": 1.0}', 'cx={"clip_by": "exact"}',
           'cl={"clip_by": "local"}', 'half={"own_share": 0.5}', "--only", "default", "plain", "cx", "cl", "half",
           "--timeout", "300", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["parties"]["2"]
    assert rows["plain"]["val_loss"] == rows["default"]["val_loss"]  # the count rule is the plain average at 2 parties
    for name in ("cx", "cl", "half"):
        assert math.isfinite(rows[name]["val_loss"]) and rows[name]["val_loss"] != rows["default"]["val_loss"], name
