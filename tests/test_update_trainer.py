"""Update mode under the Lightning Trainer, on 2 real gloo processes: what a user does keeps working.

Validation, test, predict, every callback and checkpoints see the global model, identical on every
rank; gradient clipping, LR schedulers, AdamW, gradient accumulation, bf16, manual optimization with
two optimizers, the spawn launcher (density 1 equals DDP: test_trainer_dist.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_trainer
from test_telemetry import _run_spawn_worker
from test_trainer_dist import assert_replicas_identical
from torch import nn
from trainer_worker import Net, make_data

from lightning_sparse.strategies.checkpoint import read_rank_states

pytestmark = pytest.mark.dist

# without the end-of-fit hand-over (tests/test_handover.py): what fit ends with is the exchange's own state
UPDATE = {"compress": "update", "density": 0.05, "flush_at_end": False}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("update")
    return run_trainer(
        {
            "max_steps": 30,
            "n": 512,
            "runs": [
                {
                    "name": "features",
                    "strategy": UPDATE,
                    "optimizer": "adamw",
                    "lr": 0.01,
                    "scheduler": True,
                    "gradient_clip_val": 0.5,
                    "validate": True,
                    "val_check_interval": 5,
                    "test": True,
                    "predict": True,
                    "checkpoint_every": 10,
                },
                # validation in the middle of an accumulation cycle (every 3 batches, steps of 2)
                {
                    "name": "accumulate",
                    "strategy": UPDATE,
                    "accumulate_grad_batches": 2,
                    "validate": True,
                    "val_check_interval": 3,
                },
                {"name": "bf16", "strategy": UPDATE, "precision": "bf16-mixed"},
                # fp16 AMP: each rank's own gradient scaler; updates are exchanged unscaled
                {"name": "fp16", "strategy": UPDATE, "precision": "16-mixed"},
                {"name": "manual", "strategy": UPDATE, "manual": True},
                {"name": "default", "strategy": "sparse_ddp", "optimizer": "adamw", "lr": 0.01},
            ],
        },
        root,
    )


def _full_loss(params: dict[str, torch.Tensor], n: int = 512) -> tuple[float, torch.Tensor]:
    model = Net()
    model.load_state_dict(params)
    x, y = make_data(0, n).tensors
    with torch.no_grad():
        logits = model(x)
    return float(nn.functional.cross_entropy(logits, y)), logits


@pytest.mark.parametrize("name", ["features", "accumulate", "bf16", "fp16", "manual", "default"])
def test_trains_with_identical_global_replicas(runs: dict[str, Any], name: str) -> None:
    results = runs[name]
    assert_replicas_identical(results)
    for r in results:
        assert r["global_step"] == 30  # manual: two optimizer steps a batch, 15 batches
        t = r["telemetry"]
        assert t["sent_bytes"] < t["dense_bytes"] / 3, "update mode sends a fraction of the dense bytes"
        assert r["train_acc"] > r["initial_acc"] + 0.15, (r["initial_acc"], r["train_acc"])
        if name == "default":  # the default hands every process's unsent part over at the end of fit
            assert not r["residuals"], "the hand-over empties the residuals"
        else:
            assert r["residuals"], "the unsent part is kept"
    assert results[0]["hook_step"] == 30  # one exchange per optimizer step


def test_callbacks_and_validation_see_the_global_model(runs: dict[str, Any]) -> None:
    a, b = runs["features"]
    # every callback hook at a batch end and at a validation start saw the same model on both ranks
    assert len(a["snapshots"]["batch_end"]) == 30 and len(a["snapshots"]["validation_start"]) == 6
    assert a["snapshots"] == b["snapshots"]
    # the last validation (after the last step) measured the final global model
    loss, logits = _full_loss(a["params"])
    assert a["callback_metrics"]["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert a["test"][0]["test_loss"] == pytest.approx(loss, rel=1e-5)
    # predict: each rank predicts its share of the data with the global model
    for rank, r in enumerate((a, b)):
        assert torch.allclose(r["predict"], logits[rank::2], atol=1e-5)


def test_validation_mid_accumulation_sees_the_global_model(runs: dict[str, Any]) -> None:
    a, b = runs["accumulate"]
    assert len(a["snapshots"]["validation_start"]) == 20
    assert a["snapshots"]["validation_start"] == b["snapshots"]["validation_start"]  # mid-cycle ones too
    # a batch end after an optimizer step sees the global model; one inside an accumulation cycle sees
    # the process's own view, which training keeps in the module until the step
    ends = [x["snapshots"]["batch_end"] for x in (a, b)]
    assert ends[0][1::2] == ends[1][1::2] and ends[0][0::2] != ends[1][0::2]
    loss, _ = _full_loss(a["params"])
    assert a["callback_metrics"]["val_loss"] == pytest.approx(loss, rel=1e-5)


def test_checkpoint_holds_the_global_model(runs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    a = runs["features"][0]
    root = Path(a["cwd"])
    last = torch.load(root / "ckpts" / "last.ckpt", weights_only=False)
    for key, value in last["state_dict"].items():
        assert torch.equal(value.float(), a["params"][key]), key
    assert last["lightning_sparse"]["world_size"] == 2
    # ModelCheckpoint keeps the newest step checkpoint only: its removals take the process files along
    names = sorted(p.name for p in (root / "ckpts").iterdir())
    steps = [n for n in names if n.startswith("epoch=") and n.endswith(".ckpt")]
    assert len(steps) == 1 and "step=10" not in steps[0], names
    assert [n for n in names if n.endswith(".sparse")] == sorted(f"{n}.sparse" for n in [*steps, "last.ckpt"]), names
    # every rank's residuals and optimizer state travel with it, each in its own file beside the
    # checkpoint (rank 0's optimizer state is the checkpoint's own)
    records = read_rank_states(root / "ckpts" / "last.ckpt")
    for record in records:
        assert record["state"]["compress"] == "update" and record["state"]["residuals"]
    first = last["optimizer_states"][0]["state"][0]["exp_avg"]
    second = records[1]["optimizer_states"]["optimizer_states"][0]["state"][0]["exp_avg"]
    assert not torch.equal(first, second), "each rank's AdamW followed its own gradients"


def test_spawn_launcher(tmp_path: Path) -> None:
    cfg = {"max_steps": 20, "strategy": "sparse_ddp_spawn", "optimizer": "adamw", "lr": 0.01, "log_every_n_steps": 1}
    r = _run_spawn_worker(cfg, tmp_path)
    # the main process gets the trained global model and the logged figures back
    assert r["train_acc"] > r["initial_acc"] + 0.15
    assert r["callback_metrics"]["sparse/compression_ratio"] > 3
