"""``sparse_fsdp`` with Lightning Fabric on real gloo processes (tests/fabric_fsdp_worker.py): 4
processes as 2 groups of 2 (the strategy's sharding and a parallelize_fn of one's own), exact resume
in the middle of a cycle, 2 processes in groups of 1 against Fabric's ``sparse_ddp``, and the errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import GROUP_BYTES, needs_fsdp2
from conftest import run_trainer

from lightning_sparse import FabricSparseFSDPStrategy

pytestmark = needs_fsdp2

SPARSE = {"min_numel": 256, "density": 0.05}
LOCAL = {**SPARSE, "sync_every": 4, "value_bits": 2, "warmup_steps": 0}
SHARD = {"shard_size": 2, "sharded_modules": ["Block"]}
OFFLOAD = {"offload_global": True, "offload_residual": True}


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fabric_hsdp")
    ckpt = str(root / "mid")
    config = {
        "devices": 4,
        "runs": [
            {"name": "default", "steps": 16, "args": {**SPARSE, **SHARD}, "check_joint_setup": True},
            {"name": "own_sharding", "steps": 16, "parallelize": True, "args": {**SPARSE, "shard_size": 2}},
            # saved after step 6, in the middle of a 4-step cycle; the global copy and residuals on the CPU
            {"name": "full", "steps": 14, "args": {**LOCAL, **SHARD, **OFFLOAD}, "save_at": 6, "save_to": ckpt},
            {"name": "resumed", "steps": 14, "args": {**LOCAL, **SHARD, **OFFLOAD}, "resume_from": ckpt},
            # a GPT with tied embeddings in module.model, the loop calling model.model(input_ids=..., labels=...)
            {"name": "gpt", "model": "gpt", "steps": 8, "args": {**LOCAL, **SHARD, "sharded_modules": ["GPTBlock"]}},
            # the residuals handed over after 10 steps of 4-step cycles (the last cycle unfinished)
            {"name": "flush", "steps": 10, "args": {**LOCAL, **SHARD}, "flush_residuals": True},
        ],
    }
    return {"root": root, **run_trainer(config, root / "runs", timeout=600, worker="fabric_fsdp_worker.py")}


def _by_coords(results: list[dict[str, Any]]) -> dict[tuple[int, ...], dict[str, Any]]:
    return {tuple(r["coords"]): r for r in results}


@pytest.mark.dist
@pytest.mark.parametrize("run", ["default", "own_sharding", "full"])
def test_shards_of_one_index_are_identical_across_groups(hsdp: dict[str, Any], run: str) -> None:
    ranks = _by_coords(hsdp[run])
    assert sorted(ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for shard in (0, 1):
        a, b = ranks[(0, shard)], ranks[(1, shard)]
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), f"{run}: shard {shard} of {name} differs"
        assert a["eval_loss"] == b["eval_loss"]
    first, second = ranks[(0, 0)]["params"], ranks[(0, 1)]["params"]
    assert any(not torch.equal(first[n], second[n]) for n in first if first[n].shape == second[n].shape)
    for r in hsdp[run]:
        assert r["shard_size"] == 2
        if run != "full":  # 14 noisy steps of 4-step cycles in 2 bits: the resume test's run
            assert sum(r["losses"][-4:]) < 0.8 * sum(r["losses"][:4]), r["losses"]
        assert 0 < r["telemetry"]["sent_bytes"] < r["telemetry"]["dense_bytes"]
        if GROUP_BYTES:  # counted where this torch lets FSDP2's collectives be wrapped
            assert r["group_bytes"] >= len(r["losses"]) * r["param_bytes"]  # inside the group, apart
        else:
            assert r["group_bytes"] is None
    # the evaluation saw the global model: one loss on every process
    assert len({r["eval_loss"] for r in hsdp[run]}) == 1


@pytest.mark.dist
def test_resume_mid_cycle_is_exact(hsdp: dict[str, Any]) -> None:
    full, resumed = _by_coords(hsdp["full"]), _by_coords(hsdp["resumed"])
    for coords, a in full.items():
        b = resumed[coords]
        assert a["losses"][6:] == b["losses"], coords
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), f"{coords}: {name} differs after resume"
        assert a["residuals"].keys() == b["residuals"].keys()
        for name in a["residuals"]:
            assert torch.equal(a["residuals"][name], b["residuals"][name]), f"{coords}: residual {name}"
    folder = hsdp["root"] / "mid.sparse"
    assert sorted(p.name for p in folder.iterdir()) == [f"rank0000{r}-of-00004.pt" for r in range(4)]
    assert (hsdp["root"] / "mid").is_dir()  # the global model: a torch.distributed.checkpoint folder


@pytest.mark.dist
def test_a_loop_calling_a_submodule_trains_then_evaluates_one_model(hsdp: dict[str, Any]) -> None:
    ranks = hsdp["gpt"]
    whole = ranks[0]["full"]
    for r in ranks:
        for name in whole:  # the whole model, gathered: the same on every process
            assert torch.equal(r["full"][name], whole[name]), name
        assert r["tied"] and torch.equal(r["full"]["model.wte.weight"], r["full"]["model.lm_head.weight"])
        assert r["eval_loss"] == ranks[0]["eval_loss"]
        assert sum(r["losses"][-2:]) < 0.9 * sum(r["losses"][:2]), r["losses"]
        assert 0 < r["telemetry"]["sent_bytes"] < r["telemetry"]["dense_bytes"]


@pytest.mark.dist
def test_module_and_optimizer_together_are_refused(hsdp: dict[str, Any]) -> None:
    for r in hsdp["default"]:
        assert "set the module up first" in r["joint_setup_error"]


@pytest.mark.dist
def test_groups_of_one_end_where_fabric_sparse_ddp_ends(tmp_path: Any) -> None:
    settings = {**SPARSE, "warmup_steps": 0}
    config = {
        "devices": 2,
        "steps": 12,
        "runs": [
            {"name": "groups_of_1", "args": {**settings, "shard_size": 1, "sharded_modules": ["Block"]}},
            {"name": "ddp", "strategy": "sparse_ddp", "args": settings},
        ],
    }
    out = run_trainer(config, tmp_path, timeout=600, worker="fabric_fsdp_worker.py")
    for a, b in zip(out["groups_of_1"], out["ddp"], strict=True):
        assert a["losses"] == b["losses"]
        for name in a["params"]:  # to the bit
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert a["telemetry"]["sent_bytes"] == b["telemetry"]["sent_bytes"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"compress": "gradient"}, r"compress='gradient' is not allowed with SparseFSDPStrategy"),
        ({"momentum_correction": 0.9}, r"momentum_correction=0.9 is not allowed"),
        ({"shard_size": 0}, r"shard_size=0 is not allowed: expected an int >= 1 or None"),
        ({"parallelize_fn": 3}, r"parallelize_fn=3 is not allowed: expected a callable or None"),
        ({"parallelize_fn": print, "sharded_modules": ["Block"]}, r"sharded_modules=\['Block'\] is not allowed"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FabricSparseFSDPStrategy(**kwargs)


def test_registered_with_fabric() -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy="sparse_fsdp")
    assert isinstance(fabric.strategy, FabricSparseFSDPStrategy)


@pytest.mark.dist
def test_flush_adds_the_groups_mean_residual_to_each_shard(hsdp: dict[str, Any]) -> None:
    ranks = _by_coords(hsdp["flush"])
    for shard in (0, 1):  # the two groups' processes that hold the same shard
        a, b = ranks[(0, shard)], ranks[(1, shard)]
        old_a, old_b = a["unflushed"], b["unflushed"]
        assert any(bool(e.any()) for e in old_a["residuals"].values())
        for name, old in old_a["params"].items():
            assert torch.equal(old, old_b["params"][name]), name  # one global model before
            e_a = old_a["residuals"].get(name, torch.zeros(old.numel())).view_as(old)
            e_b = old_b["residuals"].get(name, torch.zeros(old.numel())).view_as(old)
            expected = old + (e_a + e_b) / 2
            assert torch.equal(a["params"][name], expected) and torch.equal(b["params"][name], expected), name
        assert all(not bool(e.any()) for r in (a, b) for e in r["residuals"].values())
