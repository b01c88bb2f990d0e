"""BatchNorm statistics of the global model (update mode, 2 processes, Trainer).

The statistics that validation, checkpoints and the end of fit see are recomputed under the global
parameters from the last training inputs and averaged over the processes: they equal that
computation done here from the same data, they are the same on both processes, the training
itself (parameters, residuals) is untouched to the bit, and a fit resumed from a checkpoint
written after a validation equals the uninterrupted fit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run_trainer
from torch import nn

# 256 samples, batch 16, 2 ranks: 8 steps per epoch, a validation at each epoch's end (steps 8, 16,
# 24), the checkpoint after the validation of epoch 1, the fit ends at step 30, mid-epoch.
BASE: dict[str, Any] = {"n": 256, "max_steps": 30, "data_by_step": True, "model": "batchnorm", "validate": True}
STRATEGY: dict[str, Any] = {"compressor": "topk", "density": 0.05, "sync_every": 3, "warmup_steps": 0}
KEEP = 4


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("batchnorm")
    first = run_trainer(
        {
            **BASE,
            "runs": [
                {
                    "name": "recomputed",
                    "strategy": {**STRATEGY, "batchnorm_batches": KEEP},
                    "ckpt_at_epoch": 1,
                    "ckpt_out": str(root / "bn.ckpt"),
                },
                {"name": "as_trained", "strategy": {**STRATEGY, "batchnorm_batches": 0}},
            ],
        },
        root / "first",
    )
    second = run_trainer(
        {
            **BASE,
            "runs": [
                {
                    "name": "resumed",
                    "strategy": {**STRATEGY, "batchnorm_batches": KEEP},
                    "ckpt_path": str(root / "bn.ckpt"),
                }
            ],
        },
        root / "second",
    )
    return {**first, **second}


def _is_statistic(key: str) -> bool:
    return key.endswith(("running_mean", "running_var", "num_batches_tracked"))


@pytest.mark.dist
def test_training_is_untouched(fits: dict[str, Any]) -> None:
    """Recomputing the statistics changes no parameter and no residual: BatchNorm normalises a
    training batch with that batch's own statistics."""
    for rank in range(2):
        a, b = fits["recomputed"][rank], fits["as_trained"][rank]
        for key in a["params"]:
            if not _is_statistic(key):
                assert torch.equal(a["params"][key], b["params"][key]), f"rank {rank}: {key}"
        for key in a["residuals"]:
            assert torch.equal(a["residuals"][key], b["residuals"][key]), f"rank {rank}: residual {key}"
        assert any(not torch.equal(a["params"][k], b["params"][k]) for k in a["params"] if _is_statistic(k))


@pytest.mark.dist
def test_statistics_are_the_global_models_and_the_same_on_every_process(fits: dict[str, Any]) -> None:
    from trainer_worker import Net, make_data

    ranks = fits["recomputed"]
    for key in ranks[0]["params"]:  # parameters and statistics: one model on both processes
        assert torch.equal(ranks[0]["params"][key], ranks[1]["params"][key]), key
    # the same computation here: the global parameters, the inputs of the last KEEP training steps
    # of each process (the worker's data are a function of the step and the rank), averaged
    data = make_data(0, BASE["n"])
    expected: dict[str, list[torch.Tensor]] = {}
    for rank in range(2):
        net = Net("batchnorm")
        net.load_state_dict(ranks[0]["params"])
        norms = {n: m for n, m in net.named_modules() if isinstance(m, nn.BatchNorm1d)}
        for m in norms.values():
            m.reset_running_stats()
            m.momentum = None
        net.train()
        with torch.no_grad():
            for step in range(BASE["max_steps"] - KEEP, BASE["max_steps"]):
                start = (step * 2 + rank) * 16
                net(data.tensors[0][torch.arange(start, start + 16) % len(data)])
        for name, m in norms.items():
            expected.setdefault(f"{name}.running_mean", []).append(m.running_mean)
            expected.setdefault(f"{name}.running_var", []).append(m.running_var)
    for key, per_rank in expected.items():
        torch.testing.assert_close(ranks[0]["params"][key], sum(per_rank) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_resume_after_a_recomputation_equals_the_uninterrupted_fit(fits: dict[str, Any]) -> None:
    full, resumed = fits["recomputed"], fits["resumed"]
    for rank in range(2):
        for key in full[rank]["params"]:
            assert torch.equal(full[rank]["params"][key], resumed[rank]["params"][key]), f"rank {rank}: {key}"
        for key in full[rank]["residuals"]:
            assert torch.equal(full[rank]["residuals"][key], resumed[rank]["residuals"][key]), key


def test_batchnorm_batches_is_checked() -> None:
    from lightning_sparse import SparseDDPStrategy

    with pytest.raises(ValueError, match="batchnorm_batches=-1 is not allowed"):
        SparseDDPStrategy(batchnorm_batches=-1)


def test_no_batchnorm_no_hook() -> None:
    from lightning_sparse.batchnorm import GlobalBatchNorm

    assert not GlobalBatchNorm(16).attach(nn.Linear(2, 2))
    assert not GlobalBatchNorm(0).attach(nn.BatchNorm1d(2))


def test_recompute_keeps_dropout_and_random_state() -> None:
    from lightning_sparse.batchnorm import GlobalBatchNorm

    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    norms = GlobalBatchNorm(batches=3)
    assert norms.attach(net)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    net(x)
    state = torch.get_rng_state()
    norms.recompute()
    assert torch.equal(torch.get_rng_state(), state) and net.training and net[2].training
    with torch.no_grad():
        reference = net[0](x)
    torch.testing.assert_close(net[1].running_mean, reference.mean(0))
    torch.testing.assert_close(net[1].running_var, reference.var(0))
    assert not norms.stale and norms.recompute() == 0  # nothing new to recompute from
