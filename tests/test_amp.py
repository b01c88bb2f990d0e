"""fp16 AMP on 2 real gloo processes: a step that the gradient scaler skips, because one rank's
gradient overflowed, is skipped by every rank and changes nothing: the global model, every rank's
residuals, the local-step cycle and the outer optimizer stay as they were, update mode sends
nothing, and the ranks' loss scales stay identical."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run_trainer
from test_trainer_dist import assert_replicas_identical

pytestmark = pytest.mark.dist

# (run name, strategy settings, the step that overflows on rank 1)
CASES = {
    "update": ({"compress": "update", "density": 0.05}, 10),
    # with local steps and an outer optimizer with momentum, the overflow on what would have been
    # an exchange step (steps 3, 7, 11, ... close a cycle of 4)
    "update_local": ({"compress": "update", "density": 0.05, "sync_every": 4, "outer_optimizer": "nesterov"}, 11),
    "update_bits": ({"compress": "update", "density": 0.05, "value_bits": 2}, 10),
    "gradient": ({"compress": "gradient", "density": 0.05}, 10),
    "gradient_split": ({"compress": "gradient", "density": 0.05, "exchange": "split"}, 10),
}


def _assert_nothing_changed(results: list[dict[str, Any]], step: int) -> None:
    """Every rank skipped ``step``, and its module, residuals and cycle are as they were before it."""
    assert [r["skipped_steps"] for r in results] == [1, 1], "every rank's scaler skipped the step"
    for r in results:
        before, after = r["records"][step], r["records"][step + 1]
        for key, value in before["params"].items():
            assert torch.equal(after["params"][key], value), f"{key} moved in a skipped step"
        assert before["residuals"].keys() == after["residuals"].keys()
        for key, value in before["residuals"].items():
            assert torch.equal(after["residuals"][key], value), f"the residual of {key} changed in a skipped step"
        assert after["cycle"] == before["cycle"]
        assert after["scale"] == before["scale"] / 2  # the scaler backed off once


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("amp")
    return run_trainer(
        {
            "max_steps": 24,
            "n": 512,
            "precision": "16-mixed-scaler",
            "nan_rank": 1,
            "runs": [
                {"name": name, "strategy": strategy, "nan_at_step": step, "record_steps": [step, step + 1]}
                for name, (strategy, step) in CASES.items()
            ],
        },
        root,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_skipped_step_changes_nothing(runs: dict[str, Any], name: str) -> None:
    step = CASES[name][1]
    results = runs[name]
    _assert_nothing_changed(results, step)
    assert results[0]["records"][step + 1]["scale"] == results[1]["records"][step + 1]["scale"]
    if name.startswith("update"):
        for r in results:
            # one number agreed on the overflow; no exchange
            assert r["records"][step + 1]["sent_bytes"] <= 8
    assert_replicas_identical(results)
    for r in results:
        assert all(torch.isfinite(v).all() for v in r["params"].values())
        assert all(torch.isfinite(v).all() for v in r["residuals"].values())
        assert r["train_acc"] > r["initial_acc"] + 0.15  # training went on


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("amp_fabric")
    return run_trainer(
        {
            "steps": 20,
            "n": 512,
            "fp16": True,
            "runs": [
                {"name": name, "strategy": strategy, "nan_at": step, "record_steps": [step, step + 1]}
                for name, (strategy, step) in FABRIC_CASES.items()
            ],
        },
        root,
        worker="fabric_worker.py",
    )


FABRIC_CASES = {
    "update": ({"compress": "update", "density": 0.05, "sync_every": 2}, 9),
    "gradient": ({"compress": "gradient", "density": 0.05}, 9),
}


@pytest.mark.parametrize("name", list(FABRIC_CASES))
def test_skipped_step_changes_nothing_under_fabric(fabric_runs: dict[str, Any], name: str) -> None:
    step = FABRIC_CASES[name][1]
    results = fabric_runs[name]
    _assert_nothing_changed(results, step)
    for key, value in results[0]["params"].items():
        assert torch.equal(results[1]["params"][key], value)
    for r in results:
        assert r["final_acc"] > r["initial_acc"] + 0.15
