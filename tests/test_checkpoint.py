"""The checkpoint payload's files, without processes: each process's own file beside the checkpoint,
read back exactly, the mean on another number of processes read a file at a time, and clear errors
for a missing or stale file. The 2- and 4-process Trainer and Fabric runs are in test_resize,
test_fabric, test_reliability and test_update_trainer; the memory at a save in benchmarks/tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_sparse.exchange.state import SparseState
from lightning_sparse.exchange.update import UpdateExchange
from lightning_sparse.strategies.checkpoint import (
    CHECKPOINT_KEY,
    CheckpointPayload,
    mean_states,
    rank_files_dir,
    read_rank_states,
)

IO = TorchCheckpointIO()


def _payload(seed: int, update: bool = True, step: int = 7) -> CheckpointPayload:
    state = SparseState(compressor="topk", compress="update" if update else "gradient")
    g = torch.Generator().manual_seed(seed)
    state.memory.load_state_dict({"w": torch.randn(10, generator=g), "b": torch.randn(3, generator=g)})
    state.step = step
    return CheckpointPayload(state, UpdateExchange(state) if update else None)


def _optimizer(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + seed)
    return {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(10, generator=g)}}, "param_groups": []}


def _save_world(path: Path, world: int, update: bool = True) -> dict[str, Any]:
    """What ``world`` processes leave on disk: their files, and rank 0's checkpoint."""
    checkpoint: dict[str, Any] = {}
    for rank in range(world):
        optimizers = {"optimizer_states": [_optimizer(rank)]} if update else None
        entry = _payload(rank, update).save(path, rank, world, optimizers, IO)
        if rank == 0:
            checkpoint = {"state_dict": {}, **(optimizers or {}), CHECKPOINT_KEY: entry}
    IO.save_checkpoint(checkpoint, path)
    return checkpoint


def _restore(path: Path, rank: int, world: int, update: bool = True) -> tuple[CheckpointPayload, dict[str, Any]]:
    payload = _payload(99, update, step=0)
    checkpoint = IO.load_checkpoint(path)
    payload.restore(checkpoint, path, rank, world, IO, torch.device("cpu"), now=True)
    return payload, checkpoint


def test_each_process_writes_its_own_file_and_reads_it_back(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    _save_world(path, 3)
    assert sorted(os.listdir(rank_files_dir(path))) == [f"rank0000{r}-of-00003.pt" for r in range(3)]
    records = read_rank_states(path)
    assert [r["rank"] for r in records] == [0, 1, 2]
    assert "optimizer_states" not in records[0]  # rank 0's is the checkpoint's own: not written twice
    for rank in range(3):
        payload, checkpoint = _restore(path, rank, 3)
        saved = _payload(rank).state.memory.state_dict()
        restored = payload.state.memory.state_dict()
        assert restored.keys() == saved.keys()
        assert all(torch.equal(restored[k], saved[k]) for k in saved)
        assert payload.state.step == 7
        assert torch.equal(
            checkpoint["optimizer_states"][0]["state"][0]["exp_avg"], _optimizer(rank)["state"][0]["exp_avg"]
        )
        assert CHECKPOINT_KEY not in checkpoint


def test_another_number_of_processes_takes_the_mean(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    _save_world(path, 3)
    with pytest.warns(UserWarning, match="written by 3 processes and is resumed on 2"):
        payload, checkpoint = _restore(path, 0, 2)
    saved = [_payload(r).state.memory.state_dict() for r in range(3)]
    for key, value in payload.state.memory.state_dict().items():
        assert torch.equal(value, (saved[0][key] + saved[1][key] + saved[2][key]) / 3)
    expected = mean_states([[_optimizer(r)] for r in range(3)])
    got = checkpoint["optimizer_states"]
    assert torch.equal(got[0]["state"][0]["exp_avg"], expected[0]["state"][0]["exp_avg"])
    assert got[0]["state"][0]["step"] == 3


def test_gradient_mode_keeps_no_optimizer_state(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    _save_world(path, 2, update=False)
    assert all("optimizer_states" not in r for r in read_rank_states(path))
    payload, _ = _restore(path, 1, 2, update=False)
    assert torch.equal(payload.state.memory.state_dict()["w"], _payload(1, False).state.memory.state_dict()["w"])


def test_a_link_to_the_checkpoint_finds_its_files(tmp_path: Path) -> None:
    (tmp_path / "ckpts").mkdir()
    path = tmp_path / "ckpts" / "epoch=0-step=7.ckpt"
    _save_world(path, 2)
    link = tmp_path / "last.ckpt"  # another folder, as ModelCheckpoint(save_last="link") may make
    link.symlink_to(os.path.relpath(path, tmp_path))
    payload, _ = _restore(link, 1, 2)
    assert torch.equal(payload.state.memory.state_dict()["w"], _payload(1).state.memory.state_dict()["w"])


def test_missing_or_stale_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    _save_world(path, 2)
    _payload(1, step=5).save(path, 1, 2, {"optimizer_states": [_optimizer(1)]}, IO)  # a later, unfinished save
    with pytest.raises(ValueError, match=r"rank00001-of-00002.pt' is from step 5, the checkpoint .* from step 7"):
        _restore(path, 1, 2)
    os.remove(os.path.join(rank_files_dir(path), "rank00001-of-00002.pt"))
    with pytest.raises(FileNotFoundError, match=r"written by 2 processes, each with its own file"):
        _restore(path, 1, 2)
    CheckpointPayload.remove(path)
    assert not os.path.exists(rank_files_dir(path))


def test_an_entry_of_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    IO.save_checkpoint({CHECKPOINT_KEY: {"world_size": 1, "ranks": [{}]}}, path)
    with pytest.raises(ValueError, match="format None; this version reads format 2"):
        _restore(path, 0, 1)


def test_mean_states_keeps_each_dtype() -> None:
    states = [{"m": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "n": torch.tensor([1, 2])} for _ in range(3)]
    states[1]["m"] = torch.tensor([3.0, 0.0], dtype=torch.bfloat16)
    mean = mean_states(states)
    assert mean["m"].dtype == torch.bfloat16 and torch.equal(
        mean["m"].float(), torch.tensor([5 / 3, 4 / 3]).bfloat16().float()
    )
    assert torch.equal(mean["n"], torch.tensor([1, 2]))
