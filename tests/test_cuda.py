"""The CUDA/NCCL path. Skipped without a GPU (CI is CPU-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_trainer

from lightning_sparse.compressors import COMPRESSORS, CompressContext, get_compressor
from lightning_sparse.schedules import k_for

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


@pytest.mark.dist
@pytest.mark.parametrize("compressor", ["topk", "randomk"])
def test_trainer_on_one_gpu_with_nccl(compressor: str, tmp_path: Path) -> None:
    # world size 1: gradient mode (the hook compresses every step) without the byte rule, so the sparse
    # path runs on CUDA tensors and NCCL carries it
    cfg = {
        "accelerator": "cuda",
        "devices": 1,
        "max_steps": 20,
        "data_by_step": True,
        "strategy": {"compress": "gradient", "compressor": compressor, "density": 0.05, "fallback_to_dense": False},
    }
    (result,) = run_trainer(cfg, tmp_path / "cuda")
    assert result["hook_step"] == 20 and result["telemetry"]["fallback_buckets"] == 0
    assert all(torch.isfinite(v).all() for v in result["params"].values())
    # the same fit on the CPU (gloo) ends where the CUDA/NCCL one does (float rounding aside; top-k)
    (on_cpu,) = run_trainer({**cfg, "accelerator": "cpu"}, tmp_path / "cpu")
    assert abs(result["train_acc"] - on_cpu["train_acc"]) <= 0.02
    if compressor == "randomk":
        return  # its coordinates come from the device's generator: other coordinates on the CPU
    for name, value in result["params"].items():
        torch.testing.assert_close(value.cpu(), on_cpu["params"][name], rtol=1e-3, atol=1e-4)


def _update_exchange_on_cuda(rank: int, world: int, port: int, out_dir: str, settings: dict[str, Any]) -> None:
    """Update mode's exchange on CUDA tensors, two processes sharing one GPU over gloo: the checks of
    ``tests/test_sync_delay.py`` at every step (each arrival the mean of what was sent, the view
    keeping its sent part while an exchange travels, one global model), on the GPU."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from test_sync_delay import _delay_worker

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # fmt: skip
    try:
        result = _delay_worker(rank, world, device="cuda", **settings)
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize(
    "settings",
    [
        {"delay": 0, "fragments": 1, "value_bits": 2},
        {"delay": 0, "fragments": 1, "offload": True},
        {"delay": 1, "fragments": 2, "value_bits": 2},
        {"delay": 4, "fragments": 1, "offload": True},
    ],
    ids=["blocking", "offloaded", "delayed-fragments", "delayed-offloaded"],
)
def test_update_exchange_on_cuda_tensors_two_processes(tmp_path: Path, settings: dict[str, Any]) -> None:
    import torch.multiprocessing as mp

    from lightning_sparse._utils import free_port

    mp.start_processes(
        _update_exchange_on_cuda, args=(2, free_port(), str(tmp_path), settings), nprocs=2, start_method="spawn"
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(all(r["ok"]) for r in results), [r["ok"] for r in results]
    offload = settings.get("offload", False)
    # the global copy: in pinned CPU memory when offloaded, on the GPU otherwise
    assert results[0]["placed"] == ({"cpu pinned"} if offload else {"cuda:0"})
    applied = results[0]["applied"]["a"]
    assert applied == {0: [4, 8, 12], 1: [3, 7, 11], 4: [8, 12]}[settings["delay"]]


@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL ranks on one GPU are refused)")
def test_delayed_fragments_over_nccl_on_two_gpus(tmp_path: Path) -> None:
    # NCCL carries the exchange on its own stream; the ranks' next steps are queued while it travels
    strategy = {"compressor": "topk", "density": 0.05, "sync_every": 4, "sync_delay": 1, "fragments": 2}
    strategy["value_bits"] = 2
    cfg = {"accelerator": "cuda", "devices": 2, "max_steps": 22, "data_by_step": True, "strategy": strategy}
    results = run_trainer(cfg, tmp_path / "nccl", timeout=600)
    assert all(r["global_step"] == 22 for r in results)
    for name, value in results[0]["params"].items():  # the end of fit applied what was in flight: one model
        assert torch.isfinite(value).all() and torch.equal(value, results[1]["params"][name]), name
    assert results[0]["telemetry"]["sent_bytes"] > 0


@pytest.mark.dist
def test_sparse_fsdp_on_one_gpu(tmp_path: Path) -> None:
    # FSDP2 on a CUDA mesh with NCCL, the exchange bound to CUDA shards (one group of 1: nothing to send)
    config = {
        "devices": 1,
        "accelerator": "cuda",
        "steps": 12,
        "validate": True,
        "args": {"shard_size": 1, "sharded_modules": ["Block"], "sync_every": 4, "value_bits": 2, "warmup_steps": 0},
    }
    (result,) = run_trainer(config, tmp_path, timeout=600, worker="fsdp_worker.py")
    assert sum(result["losses"][-4:]) < sum(result["losses"][:4])
    assert all(t.device.type == "cuda" and torch.isfinite(t).all() for t in result["params"].values())
    assert result["group_bytes"] in (0.0, None) and result["shard_size"] == 1  # None: a torch without the hook


def test_a_bucket_is_selected_at_once_on_cuda_with_one_host_read() -> None:
    """The bucket-at-once top-k (``lightning_sparse.wire.batched``) on CUDA tensors: the coordinates
    the CPU picks for the same input, and, in a steady-state step, one synchronising operation (the
    check that every tensor's shortlist held its k), as ``tests/test_exchange_ops.py`` counts on CPUs."""
    import warnings

    from lightning_sparse.compressors import TopK
    from lightning_sparse.wire.context import BucketCall, BucketPlan, Member, WireContext
    from lightning_sparse.wire.memory import ErrorFeedback
    from lightning_sparse.wire.select import select_sorted
    from lightning_sparse.wire.stats import Counters

    members, offset = [], 0
    for i in range(48):  # a GPT's blocks: matrices with small tensors between them
        numel, sparse = ((64 * 192, True), (64, False), (64 * 64, True))[i % 3]
        members.append(Member(f"t{i}", i, offset, numel, sparse))
        offset += numel
    plan = BucketPlan(tuple(members), offset, "bucket")
    ks = [k_for(m.numel, 0.01) for m in plan.sparse_members]
    inputs = [torch.randn(offset, generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def run(device: str) -> list[torch.Tensor]:
        ctx = WireContext(TopK(), True, 0.0, None, 0, "allgather", True, None, True, memory=ErrorFeedback())
        picked = []
        for step, g in enumerate(inputs):
            call = BucketCall(g.to(device), plan, step, Counters(), inputs_finite=True)
            if step == len(inputs) - 1 and device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        sel = select_sorted(ctx, call, ks, torch.float32, settle=True)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                syncs = [w for w in caught if "synchroniz" in str(w.message)]
                assert len(syncs) <= 1, [str(w.message) for w in syncs]
            else:
                sel = select_sorted(ctx, call, ks, torch.float32, settle=True)
            picked.append(sel.coords.cpu())
        return picked

    for on_cpu, on_cuda in zip(run("cpu"), run("cuda"), strict=True):
        assert torch.equal(on_cpu, on_cuda)


def _stream_events_in_backward(wrap: Any) -> int:
    """Events recorded or waited for while one backward of a small MLP runs, its module wrapped by
    ``wrap`` (a parameter's gradient crossing CUDA streams costs these, per parameter). DDP's reducer
    is off, as update mode keeps it."""
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile

    module = wrap(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).cuda())
    x = torch.randn(32, 64, device="cuda")
    quiet = module.no_sync if hasattr(module, "no_sync") else nullcontext
    with quiet():
        for _ in range(2):  # the second backward is the steady state
            module(x).sum().backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            module(x).sum().backward()
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name in ("cudaEventRecord", "cudaStreamWaitEvent", "cudaEventQuery"))


@pytest.mark.dist
def test_ddp_is_built_on_the_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning builds DDP in a side stream, which binds every parameter's gradient to it; the sparse
    strategies build it on the current stream, so a backward crosses no stream (as without DDP)."""
    import torch.distributed as dist

    from lightning_sparse._utils import free_port
    from lightning_sparse.strategies.core import wrap_in_ddp

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        plain = _stream_events_in_backward(lambda m: m)
        ours = _stream_events_in_backward(lambda m: wrap_in_ddp(m, [0], {}))

        def lightnings(m: torch.nn.Module) -> torch.nn.Module:
            with torch.cuda.stream(torch.cuda.Stream()):
                return wrap_in_ddp(m, [0], {})

        side = _stream_events_in_backward(lightnings)
    finally:
        dist.destroy_process_group()
    assert ours <= plain + 2, (ours, plain)
    assert side >= plain + 16, (side, plain)  # the cost avoided: per parameter (16 here)


def test_random_k_draws_the_same_coordinates_on_cuda_without_a_host_read() -> None:
    """Random-k's hash (``compressors.randomk.draw_subsets``) is integer arithmetic: a bucket's
    coordinates on CUDA are the CPU's, bit for bit, and drawing them synchronises nothing."""
    import warnings

    from lightning_sparse.compressors.randomk import SubsetLayout, draw_subsets

    members, offset = [], 0
    for i in range(48):  # (key, offset, numel, k): a GPT's matrices and vectors
        numel = (64 * 192, 192, 64 * 64)[i % 3]
        members.append((1000 + i, offset, numel, k_for(numel, 0.01)))
        offset += numel
    picks = {}
    for device in ("cpu", "cuda"):
        layout = SubsetLayout.of(tuple(members), torch.device(device))
        draw_subsets(layout, seed=3, step=0)  # the first call builds what is cached
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                picks[device] = draw_subsets(layout, seed=3, step=7)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        assert not [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert torch.equal(picks["cpu"], picks["cuda"].cpu())
