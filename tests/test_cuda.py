"""The CUDA/NCCL path. Skipped without a GPU (CI is CPU-only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_trainer

from lightning_sparse.compressors import COMPRESSORS, CompressContext, get_compressor
from lightning_sparse.hook import k_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_selection_on_cuda_tensors(name: str) -> None:
    compressor = get_compressor(name)
    p = torch.randn(1_000_000, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    k = k_for(p.numel(), 0.01)
    idx = compressor.select(p, k, CompressContext(step=1, key=2, rank=0, world_size=1))
    assert idx.device.type == "cuda" and idx.numel() == k and idx.unique().numel() == k
    if name == "topk":
        got = p.abs()[idx].sort().values
        assert torch.equal(got, torch.topk(p.abs(), k).values.sort().values)


@pytest.mark.parametrize("compressor", ["topk", "randomk"])
def test_trainer_on_one_gpu_with_nccl(compressor: str, tmp_path: Path) -> None:
    # world size 1: force the sparse path (no fallback) so compression runs on CUDA tensors
    cfg = {
        "accelerator": "cuda",
        "devices": 1,
        "max_steps": 20,
        "data_by_step": True,
        "strategy": {"compressor": compressor, "density": 0.05, "fallback_to_dense": False},
    }
    (result,) = run_trainer(cfg, tmp_path)
    assert result["hook_step"] == 20 and result["telemetry"]["fallback_buckets"] == 0
    assert all(torch.isfinite(v).all() for v in result["params"].values())
    assert result["train_acc"] > result["initial_acc"] + 0.15
