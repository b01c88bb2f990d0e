"""Handing the residuals over: ``flush_residuals()`` adds the mean of every process's residual to the
global model, exactly, in the Fabric and Trainer front ends (2 processes, gloo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_trainer

from lightning_sparse import FlushResiduals, SparseDDPStrategy

#: update mode with local steps: the residuals hold the unsent part of four steps' progress
STRATEGY = {"compress": "update", "compressor": "topk", "density": 0.05, "sync_every": 4, "warmup_steps": 0}


def _by_name(residuals: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The residuals by the state_dict's key of their parameter (the exchange may name it with a prefix)."""
    out = {}
    for key, p in params.items():
        found = [e for name, e in residuals.items() if name == key or name.endswith("." + key) or key.endswith(name)]
        out[key] = found[0].view_as(p) if found else torch.zeros_like(p)
    return out


@pytest.mark.dist
def test_fabric_flush_adds_the_mean_residual_exactly(tmp_path: Path) -> None:
    # 30 steps of cycles of 4: the loop ends inside a cycle, whose progress joins the residuals first;
    # flush_residuals() and end_fit() (the documented call after a loop's last step, flush_at_end=True)
    runs = run_trainer(
        {
            "steps": 30,
            "runs": [
                {"name": "flush", "strategy": STRATEGY, "flush_residuals": True},
                {"name": "end_fit", "strategy": STRATEGY, "flush_residuals": "end_fit"},
            ],
        },
        tmp_path,
        timeout=300,
        worker="fabric_worker.py",
    )
    for name in ("flush", "end_fit"):
        _assert_mean_residual_handed_over(runs[name])
    for a, b in zip(runs["flush"], runs["end_fit"], strict=True):  # the same fit, the same hand-over
        for key, value in a["params"].items():
            assert torch.equal(value, b["params"][key]), key


def _assert_mean_residual_handed_over(ranks: list[dict[str, Any]]) -> None:
    """After a Fabric loop's exact hand-over: every process's module holds the global model before
    plus the mean of the residuals before, the residuals are empty and one float32 all-reduce of the
    parameters was counted."""
    before = [r["unflushed"] for r in ranks]
    assert before[0]["params"].keys() == ranks[0]["params"].keys()
    residuals = [_by_name(b["residuals"], b["params"]) for b in before]
    assert any(bool(e.any()) for e in residuals[0].values())  # something was left unsent
    for key, old in before[0]["params"].items():
        assert torch.equal(old, before[1]["params"][key]), key  # one global model before
        expected = old + (residuals[0][key] + residuals[1][key]) / 2
        for r in ranks:
            assert torch.equal(r["params"][key], expected), key
    for r, b in zip(ranks, before, strict=True):  # nothing left unsent; the flush's bytes counted
        assert all(not bool(e.any()) for e in r["residuals"].values())
        numel = sum(p.numel() for p in b["params"].values())
        # one float32 all-reduce of every parameter, after the one-value all-reduce that finds them unsent
        assert r["telemetry"]["sent_bytes"] - b["sent_bytes"] == 4 * numel + 4


@pytest.mark.dist
def test_fabric_flush_in_rounds_sends_what_is_left_as_configured(tmp_path: Path) -> None:
    runs = run_trainer(
        {"steps": 30, "runs": [{"name": "rounds", "strategy": STRATEGY, "flush_residuals": 4}]},
        tmp_path,
        timeout=300,
        worker="fabric_worker.py",
    )
    ranks = runs["rounds"]
    before = [r["unflushed"] for r in ranks]
    old_e = [_by_name(b["residuals"], b["params"]) for b in before]
    new_e = [_by_name(r["residuals"], r["params"]) for r in ranks]
    for key, old in before[0]["params"].items():
        assert torch.equal(ranks[0]["params"][key], ranks[1]["params"][key]), key  # one global model
        # every round adds the mean of what was sent and keeps the rest: global + mean(e) is conserved
        kept = ranks[0]["params"][key] + (new_e[0][key] + new_e[1][key]) / 2
        torch.testing.assert_close(kept, old + (old_e[0][key] + old_e[1][key]) / 2, rtol=0, atol=1e-6)
    for old, new in zip(old_e, new_e, strict=True):  # the largest part went, some is left
        left = sum(float(e.norm()) ** 2 for e in new.values())
        assert 0 < left < sum(float(e.norm()) ** 2 for e in old.values())
    sent = [r["telemetry"]["sent_bytes"] - b["sent_bytes"] for r, b in zip(ranks, before, strict=True)]
    exchange_bytes = before[0]["sent_bytes"] / 7  # 30 steps in cycles of 4: 7 exchanges before the flush
    assert sent[0] == sent[1] == pytest.approx(4 * exchange_bytes, rel=0.05)


@pytest.mark.dist
def test_trainer_flush_at_the_end_of_fit(tmp_path: Path) -> None:
    # the default (flush_at_end=True) hands over exactly what the fit without it leaves in the residuals
    cfg = {"max_steps": 30, "data_by_step": True}
    plain = run_trainer({**cfg, "strategy": {**STRATEGY, "flush_at_end": False}}, tmp_path / "plain", timeout=300)
    flushed = run_trainer({**cfg, "strategy": STRATEGY}, tmp_path / "flushed", timeout=300)
    assert "FlushResiduals" not in flushed[0]["callbacks"]
    residuals = [_by_name(r["residuals"], r["params"]) for r in plain]  # the fit without: what was left
    assert any(bool(e.any()) for e in residuals[0].values())
    for key, old in plain[0]["params"].items():
        expected = old + (residuals[0][key] + residuals[1][key]) / 2  # the same fit, then the flush
        for r in flushed:
            assert torch.equal(r["params"][key], expected), key
    for r in flushed:
        assert all(not bool(e.any()) for e in r["residuals"].values())
    # flush_at_end=R: R exchanges as configured; global + mean residual is what the fit without left
    rounds = run_trainer({**cfg, "strategy": {**STRATEGY, "flush_at_end": 4}}, tmp_path / "rounds", timeout=300)
    left = [_by_name(r["residuals"], r["params"]) for r in rounds]
    for key, old in plain[0]["params"].items():
        assert torch.equal(rounds[0]["params"][key], rounds[1]["params"][key]), key  # one global model
        kept = rounds[0]["params"][key] + (left[0][key] + left[1][key]) / 2
        torch.testing.assert_close(kept, old + (residuals[0][key] + residuals[1][key]) / 2, rtol=0, atol=1e-6)
    for r, p in zip(rounds, plain, strict=True):  # the 4 exchanges in rows of their own, nothing dense DDP sends
        assert r["methods"]["topk"] == p["methods"]["topk"]  # the fit's own exchanges, as without the hand-over
        assert r["methods"]["topk (hand-over)"] * 7 == 4 * p["methods"]["topk"]  # 7 exchanges in 30 steps
        assert r["telemetry"]["dense_bytes"] == p["telemetry"]["dense_bytes"]
    for before, after in zip(residuals, left, strict=True):  # the largest part went, some is left
        remaining = sum(float(e.norm()) ** 2 for e in after.values())
        assert 0 < remaining < sum(float(e.norm()) ** 2 for e in before.values())


def test_flush_is_for_update_mode_and_sparse_strategies() -> None:
    with pytest.raises(ValueError, match="flush_residuals\\(\\) is not allowed with compress='gradient'"):
        SparseDDPStrategy(compress="gradient").flush_residuals()
    from types import SimpleNamespace

    for bad in (0, -1, 1.5, True, "all"):
        with pytest.raises(ValueError, match="rounds=.* is not allowed"):
            FlushResiduals(rounds=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FlushResiduals needs a sparse strategy"):
        FlushResiduals().on_train_end(SimpleNamespace(strategy=object()), None)  # type: ignore[arg-type]


def test_flush_in_rounds_is_refused_under_fault_tolerance() -> None:
    from lightning_sparse.exchange.ft import ReplicaCommit
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    exchange = UpdateExchange(SparseState(compress="update"), commit=ReplicaCommit())
    with pytest.raises(ValueError, match="flush_residuals\\(rounds=4\\) is not allowed with fault_tolerant=True"):
        exchange.flush_residuals(4)
    exchange.flush_residuals()  # not joined to any group yet: nothing to hand over


def test_flush_on_one_process_changes_nothing() -> None:
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    exchange = UpdateExchange(SparseState(compress="update"))
    p = torch.nn.Parameter(torch.ones(3))
    exchange.bind([("w", p)])
    exchange.flush_residuals()
    assert torch.equal(p.detach(), torch.ones(3))
