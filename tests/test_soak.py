"""Soak: 2,000 steps on 2 processes with every compressor and with the split exchange in both modes
(marked slow; run with ``-m slow``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_trainer

from lightning_sparse.compressors import COMPRESSORS

pytestmark = pytest.mark.dist

STEPS = 2000


@pytest.mark.slow
def test_long_runs_keep_replicas_identical_and_residuals_bounded(tmp_path: Path) -> None:
    names = sorted(COMPRESSORS)
    runs = run_trainer(
        {
            "max_steps": STEPS,
            "lr": 0.02,
            "runs": [{"name": c, "strategy": {"compressor": c, "density": 0.01}} for c in names]
            # the split exchange, forced (at 2 ranks "auto" all-gathers), in both modes
            + [
                {"name": f"split_{mode}", "strategy": {"compress": mode, "exchange": "split", "density": 0.01}}
                for mode in ("update", "gradient")
            ],
        },
        tmp_path,
        timeout=3600,
    )
    for name in [*names, "split_update", "split_gradient"]:
        r0, r1 = runs[name]
        assert r0["global_step"] == STEPS
        for key in r0["params"]:
            assert torch.equal(r0["params"][key], r1["params"][key]), f"{name}: replicas drifted in {key}"
            assert torch.isfinite(r0["params"][key]).all()
        for r in (r0, r1):
            norms = torch.tensor(r["residual_norms"])
            assert torch.isfinite(norms).all(), f"{name}: non-finite residual norm"
            half = len(norms) // 2
            # error feedback keeps the residual bounded: no growth from the first half to the second
            assert norms[half:].max() <= 2.0 * norms[:half].max(), f"{name}: residual norm keeps growing"
        assert r0["train_acc"] > r0["initial_acc"] + 0.3, f"{name}: did not learn"
