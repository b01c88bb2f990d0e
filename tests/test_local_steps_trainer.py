"""Local steps with the Trainer (2 processes): a fit resumed from a checkpoint written in the middle
of a cycle of local steps equals the uninterrupted fit bit for bit, with every outer optimizer, with
coded values, with fragments and with an exchange in flight; replicas are identical at the end; the
CLI takes an outer optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import run_trainer

from lightning_sparse.strategies.checkpoint import read_rank_states

pytestmark = pytest.mark.dist

# 256 samples, batch 16, 2 ranks: 8 steps per epoch; the checkpoint at the end of epoch 1 is step 16,
# the middle of a cycle of 3 local steps (15 + 1).
BASE: dict[str, Any] = {"n": 256, "max_steps": 30, "data_by_step": True, "optimizer": "adamw", "lr": 0.01}
# without the end-of-fit hand-over (tests/test_flush.py, tests/test_handover.py): what a fit ends with is
# the exchange's own state and counts
STRATEGY: dict[str, Any] = {"compressor": "topk", "density": 0.05, "sync_every": 3, "flush_at_end": False}
CASES: dict[str, dict[str, Any]] = {
    "add": {},
    "nesterov": {"outer_optimizer": "nesterov"},
    "sgd_class": {
        "outer_optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.9, "momentum": 0.5}},
    },
    "nesterov_2bit": {"outer_optimizer": "nesterov", "value_bits": 2},
    "offloaded": {"outer_optimizer": "nesterov", "value_bits": 2, "offload_global": True, "offload_residual": True},
    # the density warm-up that keeps BatchNorm models' views together early (docs/results.md)
    "density_warmup": {
        "density": {
            "class_path": "lightning_sparse.WarmupDensity",
            "init_args": {"start": 0.3, "end": 0.05, "steps": 24},
        },
        "value_bits": 2,
    },
    # fragment a|b exchanges at steps 2, 5, ..., 29 and the other at 3, 6, ..., 30: mid-cycle for both at step 16
    "fragments": {"fragments": 2, "warmup_steps": 0},
    # launched at step 15, due at 17: the checkpoint after step 16 has the exchange in flight
    "delayed": {"sync_delay": 2, "value_bits": 2},
}
#: optimizer steps with an exchange in 30 (one every 3 steps; with 2 fragments, each its own)
EXCHANGES: dict[str, int] = {"fragments": 20}
#: every fragment's position in its cycle at the checkpoint (after step 16)
POSITIONS: dict[str, list[int]] = {"fragments": [1, 2]}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("local_steps")
    first = run_trainer(
        {
            **BASE,
            "runs": [
                {
                    "name": f"full_{name}",
                    "strategy": {**STRATEGY, **extra},
                    "ckpt_at_epoch": 1,
                    "ckpt_out": str(root / f"{name}.ckpt"),
                }
                for name, extra in CASES.items()
            ],
        },
        root / "first",
    )
    second = run_trainer(
        {
            **BASE,
            "runs": [
                {"name": f"resumed_{name}", "strategy": {**STRATEGY, **extra}, "ckpt_path": str(root / f"{name}.ckpt")}
                for name, extra in CASES.items()
            ],
        },
        root / "second",
    )
    return {"first": first, "second": second, "root": root}


@pytest.mark.parametrize("name", list(CASES))
def test_resume_mid_cycle_equals_uninterrupted_fit(launches: dict[str, Any], name: str) -> None:
    full, resumed = launches["first"][f"full_{name}"], launches["second"][f"resumed_{name}"]
    for rank in range(2):
        a, b = full[rank], resumed[rank]
        assert a["global_step"] == b["global_step"] == 30
        assert a["hook_step"] == b["hook_step"] == EXCHANGES.get(name, 10)
        for key in a["params"]:
            assert torch.equal(a["params"][key], b["params"][key]), f"rank {rank}: {key} differs after resume"
        for key in a["residuals"]:
            assert torch.equal(a["residuals"][key], b["residuals"][key]), f"rank {rank}: residual {key} differs"
        untimed = [{k: v for k, v in t.items() if k != "compress_seconds"} for t in (a["telemetry"], b["telemetry"])]
        assert untimed[0] == untimed[1]
    for key in full[0]["params"]:  # the module holds the one global model on both ranks
        assert torch.equal(full[0]["params"][key], full[1]["params"][key]), f"replicas differ in {key}"
    records = read_rank_states(launches["root"] / f"{name}.ckpt")
    cycles = [r["state"]["cycle"] for r in records]
    assert cycles[0] == cycles[1] and sorted(cycles[0].values()) == POSITIONS.get(name, [1])  # mid-cycle
    if "outer_optimizer" in CASES[name]:  # the same on every rank: once, in the checkpoint itself
        state = torch.load(launches["root"] / f"{name}.ckpt", weights_only=False)["lightning_sparse"]["outer_step"]
        assert len(state) >= 1


def test_offloaded_global_copy_trains_the_same_bits(launches: dict[str, Any]) -> None:
    # offload_global and offload_residual stage each bucket's global values and residuals on the device and
    # work on them with the same operations: the fit ends where it ends without offloading, to the bit
    for rank in range(2):
        a, b = launches["first"]["full_nesterov_2bit"][rank], launches["first"]["full_offloaded"][rank]
        for key in a["params"]:
            assert torch.equal(a["params"][key], b["params"][key]), f"rank {rank}: {key} differs"
        for key in a["residuals"]:
            assert torch.equal(a["residuals"][key], b["residuals"][key]), f"rank {rank}: residual {key} differs"


def test_compression_ratio_counts_every_optimizer_step(launches: dict[str, Any]) -> None:
    run = launches["first"]["full_add"][0]
    t = run["telemetry"]
    numel = sum(v.numel() for v in run["params"].values())
    assert t["dense_bytes"] == 30 * 4 * numel  # what dense DDP would have moved, at every optimizer step
    assert t["numel"] == 30 * numel


def test_cli_config_with_an_outer_optimizer(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_sparse import SparseDDPStrategy
    from lightning_sparse.demos import DigitsClassifier, DigitsDataModule

    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": {
                "class_path": "lightning_sparse.SparseDDPStrategy",
                "init_args": {
                    "sync_every": 8,
                    "value_bits": 4,
                    "outer_optimizer": {
                        "class_path": "torch.optim.SGD",
                        "init_args": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
                    },
                },
            },
        }
    }
    path = tmp_path / "outer.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(DigitsClassifier, DigitsDataModule, run=False, args=["--config", str(path)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, SparseDDPStrategy)
    config_ = strategy._core.config
    assert config_.sync_every == 8 and config_.value_bits == 4
    made = config_.outer_factory([torch.nn.Parameter(torch.zeros(1))])
    assert isinstance(made, torch.optim.SGD) and made.defaults["lr"] == 0.7 and made.defaults["nesterov"]


# update mode, sync_every 1, a timed fallback: the trial's dense steps (1-5) and a dense choice are plain
# DDP steps (gradients all-reduced in DDP's hook); entering them flushes every rank's unsent part into
# the global model and averages the optimizer states, so the replicas stay identical.
TIMED_UPDATE: dict[str, Any] = {"compressor": "topk", "density": 0.05, "fallback_to_dense": "time"}


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("timed_update")
    base = {**BASE, "max_steps": 24, "slow_sparse": 0.05}  # sparse made slow for real: the trial picks dense
    first = run_trainer(
        {
            **base,
            "runs": [{"name": "full", "strategy": TIMED_UPDATE, "ckpt_at_epoch": 1, "ckpt_out": str(root / "t.ckpt")}],
        },
        root / "first",
    )
    second = run_trainer(
        {**base, "runs": [{"name": "resumed", "strategy": TIMED_UPDATE, "ckpt_path": str(root / "t.ckpt")}]},
        root / "second",
    )
    return {"full": first["full"], "resumed": second["resumed"]}


def test_timed_fallback_in_update_mode_goes_to_plain_ddp(timed: dict[str, Any]) -> None:
    full = timed["full"]
    for r in full:
        (decision,) = r["timed_fallback"]["decisions"]
        assert decision["step"] == 11 and decision["choice"] == "dense"
        assert decision["sparse_s"] > decision["dense_s"]
        methods = r["methods"]
        # the unsent parts are flushed on entering plain DDP steps: the trial's dense half, then the choice
        assert methods["dense (flush)"] == 2
        assert methods["dense (timing trial)"] == 5 and methods["dense (timed fallback)"] == 24 - 11
        assert all(not bool(v.abs().sum()) for v in r["residuals"].values()), "nothing left unsent"
        assert r["hook_step"] == 24
    a, b = full
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), f"replicas differ in {key}"
    for pid, slot in a["optimizer_state"].items():  # the optimizer states were averaged, then stayed equal
        for key, value in slot.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer_state"][pid][key])), key
    for f, r in zip(full, timed["resumed"], strict=True):
        for key in f["params"]:
            assert torch.equal(f["params"][key], r["params"][key]), f"{key} differs after resume"
