"""The CUDA/NCCL path. Skipped without a GPU (CI is CPU-only)."""

from __future__ import annotations

from pathlib import Path

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


def _update_exchange_on_cuda(rank: int, world: int, port: int, out_dir: str, offload: bool = False) -> None:
    """Update mode's exchange on CUDA tensors, two processes sharing one GPU over gloo: every step
    checks conservation bit for bit and that the global model is the same on both processes."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_sparse.state import SparseState
    from lightning_sparse.update import UpdateExchange

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # fmt: skip
    try:
        torch.manual_seed(0)
        shapes = {"w": (300, 200), "v": (4000,), "b": (200,)}
        named = [(n, torch.nn.Parameter(torch.randn(s, device="cuda"))) for n, s in shapes.items()]
        state = SparseState(
            compress="update",
            density=0.02,
            min_numel=1000,
            sync_every=2,
            value_bits=2,
            warmup_steps=0,
            offload_global=offload,
            offload_residual=offload,
        )
        exchange = UpdateExchange(state)
        exchange.bind(named)
        gen = torch.Generator(device="cuda").manual_seed(rank)
        checks = 0
        for step in range(6):
            glob = {n: p.detach().clone() for n, p in named}  # the module holds the global model here
            exchange.hold_local()
            e_old = {n: state.memory.get(n).to("cuda", copy=True) if n in state.memory else None for n, _ in named}
            before = {n: p.detach().clone() for n, p in named}
            with torch.no_grad():
                for _, p in named:
                    p.add_(torch.randn(p.shape, device="cuda", generator=gen) * 0.01)
            delta = {n: (p.detach() - before[n]).reshape(-1).float() for n, p in named}
            exchange.exchange()
            for g in exchange._global.values():  # the global copy: in pinned CPU memory when offloaded
                assert g.device.type == ("cpu" if offload else "cuda") and g.is_pinned() == offload
            for n, p in named:
                e_new = state.memory.get(n)
                assert e_new.device.type == ("cpu" if offload else "cuda") and p.device.type == "cuda"
                e_new = e_new.to(p.device)
                old = e_old[n] if e_old[n] is not None else torch.zeros_like(e_new)
                if step % 2 == 0:  # a local step: its progress joins the residual exactly, nothing moves
                    assert torch.equal(e_new, old + delta[n]) and torch.equal(p.detach(), glob[n])
                    continue
                sent = old + delta[n] - e_new
                every = [torch.empty_like(sent) for _ in range(world)]
                dist.all_gather(every, sent)
                moved = (p.detach() - glob[n]).reshape(-1)
                # the global model moved by the mean of what the processes sent, nothing more or less
                torch.testing.assert_close(moved, sum(every) / world, rtol=1e-5, atol=1e-6)
                assert sent.count_nonzero() > 0
                checks += 1
            flat = torch.cat([p.detach().reshape(-1) for _, p in named])
            every = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(every, flat)
            assert torch.equal(every[0], every[1]), "the global model differs between the processes"
        torch.save({"checks": checks, "steps": state.step}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("offload", [False, True])
def test_update_exchange_on_cuda_tensors_two_processes(tmp_path: Path, offload: bool) -> None:
    import torch.multiprocessing as mp

    from lightning_sparse._utils import free_port

    args = (2, free_port(), str(tmp_path), offload)
    mp.start_processes(_update_exchange_on_cuda, args=args, nprocs=2, start_method="spawn")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(r["checks"] == 9 and r["steps"] == 3 for r in results)


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
