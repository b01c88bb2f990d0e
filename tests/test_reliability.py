"""Reliability: exact resume, non-finite gradients, world size 1, odd models, mismatched ranks.

Trainer runs are grouped into a few launches (several fits per launch) to keep the suite fast.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import run_trainer

from lightning_sparse.compressors import COMPRESSORS
from lightning_sparse.strategies.checkpoint import read_rank_states

pytestmark = pytest.mark.dist

NAMES = sorted(COMPRESSORS)
# 256 samples, batch 16, 2 ranks: 8 steps per epoch; the checkpoint is written at the end of epoch 1.
# Batches are a function of (step, rank) ("data_by_step"), so a resumed run sees the same data as an
# uninterrupted one whatever Lightning's loop does with samplers on restart.
BASE: dict[str, Any] = {"n": 256, "max_steps": 32, "density": 0.05, "data_by_step": True}


# the trial: dense steps 1-5, sparse steps 6-10, the choice at step 11 (the checkpoint is at step 16)
TIMED: dict[str, Any] = {
    "compressor": "topk",
    "density": BASE["density"],
    "fallback_to_dense": "time",
    "flush_at_end": False,
}


def _strategy(name: str, compress: str = "gradient") -> dict[str, Any]:
    # no dense fallback: every step after warm-up takes the compressor's own path; update mode without the
    # end-of-fit hand-over, so that what a fit ends with is the exchange's state, residuals and all
    extra = {"flush_at_end": False} if compress == "update" else {}
    return {"compressor": name, "density": BASE["density"], "fallback_to_dense": False, "compress": compress, **extra}


# update mode: each rank's own AdamW (its state differs per rank and must come back on resume)
UPDATE_RUN: dict[str, Any] = {"optimizer": "adamw", "lr": 0.01}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reliability")
    base = {k: v for k, v in BASE.items() if k != "density"}
    first = run_trainer(
        {
            **base,
            "runs": [
                *(
                    {
                        "name": f"full_{c}",
                        "strategy": _strategy(c),
                        "ckpt_at_epoch": 1,
                        "ckpt_out": str(root / f"{c}.ckpt"),
                    }
                    for c in NAMES
                ),
                *(
                    {
                        "name": f"full_update_{c}",
                        "strategy": _strategy(c, "update"),
                        **UPDATE_RUN,
                        "ckpt_at_epoch": 1,
                        "ckpt_out": str(root / f"update_{c}.ckpt"),
                    }
                    for c in NAMES
                ),
                # the split exchange (forced: at 2 ranks "auto" all-gathers), in both modes
                *(
                    {
                        "name": f"full_split_{mode}",
                        "strategy": {**_strategy("topk", mode), "exchange": "split"},
                        **(UPDATE_RUN if mode == "update" else {}),
                        "ckpt_at_epoch": 1,
                        "ckpt_out": str(root / f"split_{mode}.ckpt"),
                    }
                    for mode in ("update", "gradient")
                ),
                {"name": "nan", "strategy": {"compress": "gradient"}, "nan_at_step": 10, "nan_rank": 1},
                # update mode: rank 1 skips its own step; rank 0's optimizer steps as usual
                {"name": "nan_update", "strategy": "sparse_ddp", "nan_at_step": 10, "nan_rank": 1},
                # fp16 AMP: a real GradScaler halves its scale after the overflow; residuals follow it
                {
                    "name": "fp16_scaler",
                    "strategy": {"compress": "gradient"},
                    "precision": "16-mixed",
                    "nan_at_step": 10,
                    "nan_rank": 1,
                },
                {"name": "all_small", "strategy": {"min_numel": 10**9, "flush_at_end": False}},
                {
                    "name": "full_timed",
                    "strategy": TIMED,
                    "slow_dense_all_reduce": 0.1,  # dense made slow for real, far beyond noise: the trial picks sparse
                    "ckpt_at_epoch": 1,
                    "ckpt_out": str(root / "timed.ckpt"),
                },
                {
                    "name": "full_momentum",
                    "strategy": {**_strategy("randomk"), "momentum_correction": 0.9},
                    "momentum": 0.0,
                    "ckpt_at_epoch": 1,
                    "ckpt_out": str(root / "momentum.ckpt"),
                },
            ],
        },
        root / "first",
    )
    second = run_trainer(
        {
            **base,
            "runs": [
                *(
                    {"name": f"resumed_{c}", "strategy": _strategy(c), "ckpt_path": str(root / f"{c}.ckpt")}
                    for c in NAMES
                ),
                *(
                    {
                        "name": f"resumed_update_{c}",
                        "strategy": _strategy(c, "update"),
                        **UPDATE_RUN,
                        "ckpt_path": str(root / f"update_{c}.ckpt"),
                    }
                    for c in NAMES
                ),
                {
                    "name": "resumed_timed",
                    "strategy": TIMED,
                    "slow_dense_all_reduce": 0.1,
                    "ckpt_path": str(root / "timed.ckpt"),
                },
                *(
                    {
                        "name": f"resumed_split_{mode}",
                        "strategy": {**_strategy("topk", mode), "exchange": "split"},
                        **(UPDATE_RUN if mode == "update" else {}),
                        "ckpt_path": str(root / f"split_{mode}.ckpt"),
                    }
                    for mode in ("update", "gradient")
                ),
                {"name": "changed", "strategy": _strategy("randomk"), "ckpt_path": str(root / "topk.ckpt")},
                {
                    "name": "resumed_momentum",
                    "strategy": {**_strategy("randomk"), "momentum_correction": 0.9},
                    "momentum": 0.0,
                    "ckpt_path": str(root / "momentum.ckpt"),
                },
            ],
        },
        root / "second",
    )
    single = run_trainer(
        {
            **base,
            "devices": 1,
            "runs": [
                # resume the 2-process topk checkpoint on 1 process; max_steps = the checkpoint's step,
                # so the residuals are the restored ones, untouched by training
                {
                    "name": "regrown",
                    "strategy": _strategy("topk"),
                    "ckpt_path": str(root / "topk.ckpt"),
                    "max_steps": 16,
                },
                {"name": "auto", "strategy": "auto", "max_steps": 20},
                {"name": "sparse_default", "strategy": "sparse_ddp", "max_steps": 20},
                {"name": "sparse_gradient", "strategy": {"compress": "gradient"}, "max_steps": 20},
                {"name": "sparse_forced", "strategy": {"density": 1.0, "fallback_to_dense": False}, "max_steps": 20},
                {"name": "sparse_timed", "strategy": {"fallback_to_dense": "time"}, "max_steps": 20},
            ],
        },
        root / "single",
    )
    return {
        "first": first,
        "second": second,
        "single": single,
        "root": root,
        "logs": {k: (root / k / "log.txt").read_text() for k in ("first", "second", "single")},
    }


@pytest.mark.parametrize(
    "name", [*NAMES, "momentum", "timed", *(f"update_{c}" for c in NAMES), "split_update", "split_gradient"]
)
def test_resume_equals_uninterrupted_run(launches: dict[str, Any], name: str) -> None:
    full, resumed = launches["first"][f"full_{name}"], launches["second"][f"resumed_{name}"]
    for rank in range(2):
        a, b = full[rank], resumed[rank]
        assert a["global_step"] == b["global_step"] == 32
        assert a["hook_step"] == b["hook_step"] == 32
        for key in a["params"]:
            assert torch.equal(a["params"][key], b["params"][key]), f"rank {rank}: {key} differs after resume"
        assert a["residuals"].keys() == b["residuals"].keys()
        for key in a["residuals"]:
            assert torch.equal(a["residuals"][key], b["residuals"][key]), f"rank {rank}: residual {key} differs"
        assert a["telemetry"]["sent_bytes"] == b["telemetry"]["sent_bytes"]
    if name.startswith("update_") or name == "split_update":  # the module holds the global model on both ranks
        for key in full[0]["params"]:
            assert torch.equal(full[0]["params"][key], full[1]["params"][key]), f"replicas differ in {key}"
    # the residuals differ per rank, so the checkpoint must have carried both ranks' residuals
    assert any(not torch.equal(full[0]["residuals"][k], full[1]["residuals"][k]) for k in full[0]["residuals"])


def test_timed_fallback_choice_is_kept_on_resume(launches: dict[str, Any]) -> None:
    full, resumed = launches["first"]["full_timed"], launches["second"]["resumed_timed"]
    assert full[0]["timed_fallback"] == full[1]["timed_fallback"]  # the same numbers on every rank
    (decision,) = full[0]["timed_fallback"]["decisions"]
    assert decision["step"] == 11 and decision["choice"] == "sparse"
    assert decision["dense_s"] > decision["sparse_s"]  # the choice follows the times (no margin asserted: noisy)
    assert "timed fallback at step 11: exchange window sparse" in launches["logs"]["first"]  # in the summary
    for rank in range(2):
        # restored from the checkpoint, not timed again; the way every step was sent is the same
        assert resumed[rank]["timed_fallback"] == full[rank]["timed_fallback"]
        assert resumed[rank]["methods"] == full[rank]["methods"]
        methods = full[rank]["methods"]
        assert methods["dense (warm-up)"] == 1 and methods["dense (timing trial)"] == 5 and methods["topk"] == 26


def test_checkpoint_holds_every_rank_state(launches: dict[str, Any]) -> None:
    ckpt = torch.load(launches["root"] / "topk.ckpt", weights_only=True)
    assert ckpt["lightning_sparse"]["world_size"] == 2 and ckpt["lightning_sparse"]["step"] == 16
    records = read_rank_states(launches["root"] / "topk.ckpt")
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["state"]["step"] == 16 for r in records)
    assert sorted(p.name for p in (launches["root"] / "topk.ckpt.sparse").iterdir()) == [
        "rank00000-of-00002.pt",
        "rank00001-of-00002.pt",
    ]


def test_resume_on_other_world_size_warns_and_keeps_mean_residual(launches: dict[str, Any]) -> None:
    assert "written by 2 processes and is resumed on 1" in launches["logs"]["single"]
    saved = [r["state"] for r in read_rank_states(launches["root"] / "topk.ckpt")]
    restored = launches["single"]["regrown"][0]["residuals"]
    assert restored.keys() == saved[0]["residuals"].keys()
    for key, value in restored.items():
        assert torch.equal(value, (saved[0]["residuals"][key] + saved[1]["residuals"][key]) / 2)


def test_resume_with_other_compressor_warns_and_trains(launches: dict[str, Any]) -> None:
    assert "written with compressor TopK" in launches["logs"]["second"]
    changed = launches["second"]["changed"]
    assert changed[0]["global_step"] == 32
    for key in changed[0]["params"]:
        assert torch.equal(changed[0]["params"][key], changed[1]["params"][key])


def test_nonfinite_update_on_one_rank_stays_on_that_rank(launches: dict[str, Any]) -> None:
    runs = launches["first"]["nan_update"]
    assert [r["skipped_steps"] for r in runs] == [0, 1]  # rank 1 skipped its own step only
    for key in runs[0]["params"]:
        assert torch.equal(runs[0]["params"][key], runs[1]["params"][key])
        assert torch.isfinite(runs[0]["params"][key]).all()
    for r in runs:
        assert all(torch.isfinite(v).all() for v in r["residuals"].values())
        assert r["train_acc"] > r["initial_acc"] + 0.15


@pytest.mark.parametrize("run", ["nan", "fp16_scaler"])
def test_nonfinite_gradient_on_one_rank_is_skipped_everywhere(launches: dict[str, Any], run: str) -> None:
    runs = launches["first"][run]
    assert [r["skipped_steps"] for r in runs] == [1, 1]  # both ranks saw a non-finite average
    assert runs[1]["telemetry"]["nonfinite_buckets"] >= 1 and runs[0]["telemetry"]["nonfinite_buckets"] == 0
    for key in runs[0]["params"]:
        assert torch.equal(runs[0]["params"][key], runs[1]["params"][key])
        assert torch.isfinite(runs[0]["params"][key]).all()
    for r in runs:
        assert all(torch.isfinite(v).all() for v in r["residuals"].values())
        assert all(n == n and n < float("inf") for n in r["residual_norms"])  # never NaN/Inf
        assert r["train_acc"] > r["initial_acc"] + 0.15  # training went on


def test_model_with_only_small_tensors_goes_dense(launches: dict[str, Any]) -> None:
    runs = launches["first"]["all_small"]
    t = runs[0]["telemetry"]
    assert t["dense_buckets"] == t["buckets"] and t["sent_bytes"] == t["dense_bytes"]
    assert runs[0]["residuals"] == {}
    for key in runs[0]["params"]:
        assert torch.equal(runs[0]["params"][key], runs[1]["params"][key])


def test_world_size_one_equals_no_strategy(launches: dict[str, Any]) -> None:
    single = launches["single"]
    ref = single["auto"][0]["params"]
    for run in ("sparse_default", "sparse_gradient", "sparse_forced", "sparse_timed"):
        got = single[run][0]
        assert got["global_step"] == 20
        for key in ref:
            assert torch.equal(got["params"][key], ref[key]), f"{run}: {key} differs from the plain run"
    assert single["sparse_forced"][0]["telemetry"]["fallback_buckets"] == 0
    assert single["sparse_timed"][0]["timed_fallback"]["decisions"] == []  # nothing to time on one process


# --------------------------------------------------------------------------- on the process group
def _mismatch_worker(rank: int, world: int) -> None:
    from lightning_sparse import SparseState

    state = SparseState(density=0.01 if rank == 0 else 0.02)
    state.bind([("w", torch.zeros(4096, requires_grad=True))])


def test_mismatched_configuration_is_detected_at_setup(dist2) -> None:
    with pytest.raises(AssertionError, match=r"configured differently across ranks.*schedule"):
        dist2.run(_mismatch_worker, timeout=60)


def _zero_and_nan_worker(rank: int, world: int, compressor: str) -> dict[str, Any]:
    from lightning_sparse import SparseState
    from lightning_sparse.exchange.hook import communicate

    named = [("w", torch.zeros(5000, requires_grad=True)), ("b", torch.zeros(10, requires_grad=True))]
    params = [p for _, p in named]
    state = SparseState(compressor=compressor, density=0.01, min_numel=100, warmup_steps=1)
    state.bind(named)
    out: dict[str, Any] = {}
    zero = torch.zeros(5010)
    communicate(state, zero.clone(), params).wait()  # dense warm-up step
    out["zero"] = communicate(state, zero.clone(), params).wait().clone()  # all-zero sparse step
    g = torch.randn(5010, generator=torch.Generator().manual_seed(rank))
    communicate(state, g.clone(), params).wait()
    before = state.memory.get("w").clone()
    bad = g.clone()
    if rank == 1:
        bad[17] = float("nan")
    out["nan"] = communicate(state, bad, params).wait().clone()
    out["residual_kept"] = torch.equal(state.memory.get("w"), before)
    out["nonfinite"] = state.telemetry.last.nonfinite_buckets
    state.config = dataclasses.replace(
        state.config, warmup_steps=100
    )  # force the dense path, which flushes residuals, with a NaN again
    bad = g.clone()
    if rank == 1:
        bad[3] = float("inf")
    before = state.memory.get("w").clone()
    out["dense_nan"] = communicate(state, bad, params).wait().clone()
    out["dense_residual_kept"] = torch.equal(state.memory.get("w"), before)
    out["after"] = communicate(state, g.clone(), params).wait().clone()
    out["after_residual_finite"] = bool(torch.isfinite(state.memory.get("w")).all()) if "w" in state.memory else True
    return out


@pytest.mark.parametrize("compressor", NAMES)
def test_zero_and_nonfinite_buckets(dist2, compressor: str) -> None:
    r = dist2.run(_zero_and_nan_worker, compressor=compressor)
    for rank in range(2):
        assert torch.equal(r[rank]["zero"], torch.zeros(5010))
        assert not torch.isfinite(r[rank]["nan"][:5000]).all(), "the non-finite gradient must reach every rank"
        assert not torch.isfinite(r[rank]["dense_nan"]).all()
        assert torch.isfinite(r[rank]["after"]).all()
        assert r[rank]["after_residual_finite"]
    # bit-identical on both ranks, NaNs included
    for key in ("nan", "dense_nan", "after"):
        assert torch.equal(r[0][key].view(torch.int32), r[1][key].view(torch.int32)), key
    assert r[1]["residual_kept"] and r[1]["dense_residual_kept"] and r[1]["nonfinite"] == 1
    assert r[0]["nonfinite"] == 0
