"""Resuming on another number of processes (the resize rule), on real gloo processes, both modes.

A checkpoint holds every rank's residuals (and, in update mode, every rank's optimizer state). On
another number of processes every new rank starts from the mean of the saved residuals (the total
unsent progress is kept: nothing is dropped) and, in update mode, from the mean of the saved
optimizer states. 4 -> 2 and 2 -> 4 here; 2 nodes x 2 -> 1 node x 2 under torchrun in
tests/test_examples.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run_trainer
from test_trainer_dist import assert_replicas_identical
from torch import nn
from trainer_worker import Net, make_data

from lightning_sparse.strategies.checkpoint import mean_states

pytestmark = pytest.mark.dist

# update mode with AdamW (every rank's own optimizer state); gradient mode with SGD and momentum,
# what it is for (the optimizer states are the same on every rank)
MODES = {
    "update": {"strategy": {"compress": "update", "density": 0.05}, "optimizer": "adamw", "lr": 0.01},
    "gradient": {"strategy": {"compress": "gradient", "density": 0.05}, "optimizer": "sgd", "lr": 0.05},
}
SAVED_AT, STEPS = 8, 28
BASE = {"n": 512, "data_by_step": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("resize")
    ckpt = {(mode, w): str(root / f"{mode}{w}.ckpt") for mode in MODES for w in (2, 4)}
    results: dict[str, Any] = {"logs": {}}
    for world in (4, 2):
        saved = run_trainer(
            {
                **BASE,
                "devices": world,
                "runs": [
                    {"name": mode, **s, "max_steps": SAVED_AT, "save_ckpt": ckpt[(mode, world)]}
                    for mode, s in MODES.items()
                ],
            },
            root / f"save{world}",
        )
        results.update({f"{mode}{world}_saved": saved[mode] for mode in MODES})
    for world, other in ((2, 4), (4, 2)):
        out = root / f"resume{world}"
        resumed = run_trainer(
            {
                **BASE,
                "devices": world,
                "runs": [
                    *(
                        # resumed with no step to take: what the resize rule restored
                        {
                            "name": f"{mode}_restored",
                            **s,
                            "max_steps": SAVED_AT,
                            "ckpt_path": ckpt[(mode, other)],
                        }
                        for mode, s in MODES.items()
                    ),
                    *(
                        {
                            "name": f"{mode}_resized",
                            **s,
                            "max_steps": STEPS,
                            "ckpt_path": ckpt[(mode, other)],
                            "record_steps": [SAVED_AT + 1],
                        }
                        for mode, s in MODES.items()
                    ),
                    *({"name": f"{mode}_full", **s, "max_steps": STEPS} for mode, s in MODES.items()),
                ],
            },
            out,
        )
        results.update({f"{other}to{world}_{name}": r for name, r in resumed.items()})
        results["logs"][f"{other}to{world}"] = (out / "log.txt").read_text()
    return results


def _loss(params: dict[str, torch.Tensor]) -> float:
    model = Net()
    model.load_state_dict(params)
    x, y = make_data(0, 512).tensors
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("change", ["4to2", "2to4"])
def test_resize_rule(runs: dict[str, Any], mode: str, change: str) -> None:
    old, new = (int(w) for w in change.split("to"))
    assert f"written by {old} processes and is resumed on {new}" in runs["logs"][change]
    ckpt = runs[f"{mode}{old}_saved"]  # the saving ranks' own states at the checkpoint
    restored = runs[f"{change}_{mode}_restored"]
    assert len(restored) == new
    for r in restored:
        # every new rank: the mean of the saved residuals
        assert r["residuals"].keys() == ckpt[0]["residuals"].keys()
        for key, value in r["residuals"].items():
            expected = sum(saved["residuals"][key] for saved in ckpt) / old
            assert torch.equal(value, expected), f"residual {key}"
    optimizer_states = [r["optimizer_state"] for r in restored]
    expected = (
        mean_states([saved["optimizer_state"] for saved in ckpt]) if mode == "update" else ckpt[0]["optimizer_state"]
    )
    for state in optimizer_states:  # update mode: the mean of the saved states; gradient mode: they were equal
        for index, entry in expected.items():
            for key, value in entry.items():
                assert torch.equal(state[index][key], value), f"optimizer state {index}.{key}"
    resized = runs[f"{change}_{mode}_resized"]
    assert_replicas_identical(resized)
    first = [r["records"][SAVED_AT + 1]["params"] for r in resized]
    for key, value in first[0].items():
        assert all(torch.equal(p[key], value) for p in first[1:]), f"{key} differs after the first step"
    full = runs[f"{change}_{mode}_full"]
    # training went on: within noise of the uninterrupted run on the new number of processes
    after, uninterrupted = _loss(resized[0]["params"]), _loss(full[0]["params"])
    print(f"{old} -> {new} processes, {mode} mode: loss {after:.4f} resized, {uninterrupted:.4f} uninterrupted")
    assert abs(after - uninterrupted) < 0.1
    assert resized[0]["train_acc"] > resized[0]["initial_acc"] + 0.2
