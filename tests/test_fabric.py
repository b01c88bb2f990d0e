"""Lightning Fabric: ``Fabric(strategy="sparse_ddp")`` on 2 real gloo processes, and its arguments.

The loops run in tests/fabric_worker.py, launched through ``subprocess.run(..., timeout=)`` (Fabric's
popen launcher starts the second rank), so a hung rank fails the test instead of hanging the suite.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_trainer
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

import lightning_sparse
from lightning_sparse import FabricSparseDDPStrategy, SparseDDPStrategy
from lightning_sparse.strategies.checkpoint import read_rank_states

HERE = Path(__file__).parent

UPDATE = {"compress": "update", "density": 0.05}
GRADIENT = {"compress": "gradient", "density": 0.05}


def run_fabric(config: dict[str, Any], out_dir: Path, timeout: float = 300) -> dict[str, list[dict[str, Any]]]:
    """Launch tests/fabric_worker.py; return each run's per-rank results by run name."""
    return run_trainer(config, out_dir, timeout=timeout, worker="fabric_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fabric")
    result = run_fabric(
        {
            "steps": 30,
            "runs": [
                # uninterrupted runs that write a checkpoint after step 15, then runs resumed from it
                {"name": "update", "strategy": UPDATE, "save_at": 15, "save_to": str(root / "update.ckpt")},
                {"name": "update_resumed", "strategy": UPDATE, "resume_from": str(root / "update.ckpt")},
                {"name": "gradient", "strategy": GRADIENT, "save_at": 15, "save_to": str(root / "gradient.ckpt")},
                {"name": "gradient_resumed", "strategy": GRADIENT, "resume_from": str(root / "gradient.ckpt")},
                # the split exchange (forced: at 2 ranks "auto" all-gathers)
                {"name": "split", "strategy": {**UPDATE, "exchange": "split"}},
                # the registered name with its defaults (update, top-k 1%), AdamW, gradient accumulation
                # over 2 micro-batches and an evaluation every 3 micro-batches (mid-cycle every other time)
                {
                    "name": "named",
                    "strategy": "sparse_ddp",
                    "optimizer": "adamw",
                    "lr": 0.01,
                    "steps": 20,
                    "accumulate": 2,
                    "eval_every": 3,
                },
            ],
        },
        root,
    )
    result["root"] = root
    return result


def assert_identical_replicas(results: list[dict[str, Any]], sync_every: int = 1) -> None:
    a, b = results
    for key, value in a["params"].items():
        assert torch.equal(value, b["params"][key]), key
    # after every exchange the module holds the global model, the same on both ranks; between exchanges
    # each rank's own view
    exchanged = slice(sync_every - 1, None, sync_every)
    assert a["after_step"][exchanged] == b["after_step"][exchanged], "the global model differs between the ranks"
    if sync_every > 1:
        assert a["after_step"][0::sync_every] != b["after_step"][0::sync_every]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["update", "gradient", "named", "split"])
def test_trains_with_identical_replicas_and_compresses(runs: dict[str, Any], name: str) -> None:
    results = runs[name]
    assert_identical_replicas(results)
    expected_mode = "gradient" if name == "gradient" else "update"
    for r in results:
        assert r["strategy"] == "lightning_sparse.fabric.ddp.SparseDDPStrategy"
        assert r["compress"] == expected_mode
        t = r["telemetry"]
        assert t["sent_bytes"] > 0 and t["dense_bytes"] > 0
        # traffic: what a dense all-reduce would move through a rank over what the collectives moved
        assert r["compression_ratio"] == pytest.approx(t["dense_wire_bytes"] / t["wire_bytes"])
        assert r["compression_ratio"] > 3, "sparse communication sends a fraction of the dense bytes"
        assert r["final_acc"] > r["initial_acc"] + 0.15, (r["initial_acc"], r["final_acc"])
        assert r["residuals"], "the unsent part is kept"
        assert r["hook_step"] == (20 if name == "named" else 30), "one exchange per optimizer step"
    # the ranks trained on different data: their unsent parts differ
    a, b = (r["residuals"] for r in results)
    assert any(not torch.equal(a[n], b[n]) for n in a)


@pytest.mark.dist
def test_named_strategy_defaults(runs: dict[str, Any]) -> None:
    r = runs["named"][0]
    # top-k 1%: a larger ratio than density 0.05 gives
    assert r["compression_ratio"] > runs["update"][0]["compression_ratio"]


@pytest.mark.dist
def test_evaluation_mid_accumulation_sees_the_global_model(runs: dict[str, Any]) -> None:
    a, b = runs["named"]
    assert len(a["at_eval"]) == 40 // 3
    assert a["at_eval"] == b["at_eval"], "evaluations see the same (global) model on both ranks"


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["update", "gradient"])
def test_resume_is_exact(runs: dict[str, Any], mode: str) -> None:
    full, resumed = runs[mode], runs[f"{mode}_resumed"]
    for f, r in zip(full, resumed, strict=True):
        assert r["after_step"] == f["after_step"][15:]
        for key, value in f["params"].items():
            assert torch.equal(value, r["params"][key]), key
        assert f["residuals"].keys() == r["residuals"].keys()
        for key, value in f["residuals"].items():
            assert torch.equal(value, r["residuals"][key]), key
        assert r["hook_step"] == f["hook_step"] == 30
        timing = "compress_seconds"  # measured time: the only figure that may differ
        assert {k: v for k, v in r["telemetry"].items() if k != timing} == {
            k: v for k, v in f["telemetry"].items() if k != timing
        }
        for pid, slot in f["optimizer"]["state"].items():
            for key, value in slot.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(r["optimizer"]["state"][pid][key])), key


@pytest.mark.dist
def test_checkpoint_carries_every_ranks_state(runs: dict[str, Any]) -> None:
    ckpt = torch.load(runs["root"] / "update.ckpt", weights_only=False)
    assert ckpt["step"] == 15 and "model" in ckpt and "optimizer" in ckpt
    assert ckpt["lightning_sparse"]["world_size"] == 2 and ckpt["lightning_sparse"]["files"] == "update.ckpt.sparse"
    records = read_rank_states(runs["root"] / "update.ckpt")
    assert [r["rank"] for r in records] == [0, 1]
    for record in records:
        assert record["state"]["compress"] == "update" and record["state"]["residuals"]
        assert record["state"]["step"] == 15
    # rank 0's optimizer state is the checkpoint's own (not written twice), rank 1's is in its file
    assert "optimizer_states" not in records[0]
    first = ckpt["optimizer"]["state"][0]["momentum_buffer"]
    second = records[1]["optimizer_states"]["optimizer"]["state"][0]["momentum_buffer"]
    assert not torch.equal(first, second), "each rank's optimizer followed its own gradients"
    # gradient mode: one optimizer state (DDP averaged the gradients), residuals of both ranks
    records = read_rank_states(runs["root"] / "gradient.ckpt")
    assert all(r["state"]["compress"] == "gradient" and r["state"]["residuals"] for r in records)
    assert all("optimizer_states" not in r for r in records)


# ---------------------------------------------------------------------- no processes needed


def test_registers_names_with_fabric_idempotently() -> None:
    names = {"sparse_ddp", "sparse_ddp_spawn", "sparse_ddp_fork", "sparse_ddp_find_unused_parameters_true"}
    assert names <= set(STRATEGY_REGISTRY)
    importlib.reload(lightning_sparse)  # importing / registering twice is fine
    lightning_sparse.register_fabric_strategies()
    lightning_sparse.register_fabric_strategies()
    for name in names:
        assert STRATEGY_REGISTRY[name]["strategy"] is lightning_sparse.FabricSparseDDPStrategy
    assert STRATEGY_REGISTRY["sparse_ddp_spawn"]["init_params"]["start_method"] == "spawn"
    fabric = Fabric(accelerator="cpu", devices=2, strategy="sparse_ddp")
    assert isinstance(fabric.strategy, FabricDDPStrategy)
    assert type(fabric.strategy).__name__ == "SparseDDPStrategy" and fabric.strategy._start_method == "popen"
    assert fabric.strategy.sparse_state.config.compress == "update"
    fabric = Fabric(accelerator="cpu", devices=2, strategy="sparse_ddp_find_unused_parameters_true")
    assert fabric.strategy._ddp_kwargs["find_unused_parameters"] is True


def test_same_configuration_as_the_trainer_strategy() -> None:
    kwargs = {"compressor": "gaussiank", "density": 0.002, "bucket_cap_mb": 5, "static_graph": True}
    for mode, view in (("update", True), ("gradient", False)):
        fabric_s = FabricSparseDDPStrategy(compress=mode, **kwargs)
        trainer_s = SparseDDPStrategy(compress=mode, **kwargs)
        assert fabric_s._ddp_kwargs == trainer_s._ddp_kwargs
        assert fabric_s._ddp_kwargs["gradient_as_bucket_view"] is view
        assert fabric_s.sparse_state.fingerprint() == trainer_s.sparse_state.fingerprint()
        assert (fabric_s.update_exchange is None) == (mode == "gradient")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"compress": "weights"},
        {"density": 0.0},
        {"density": 1.5},
        {"density": "dense"},
        {"compressor": "zip"},
        {"compressor": 3},
        {"min_numel": -1},
        {"warmup_steps": 0, "compress": "gradient"},
        {"warmup_steps": -1},
        {"seed": -3},
        {"value_dtype": "int8"},
        {"error_feedback": "yes"},
        {"fallback_to_dense": 1},
        {"momentum_correction": 1.0},
        {"momentum_correction": 0.9},  # with compress="update"
        {"static_graph": "no"},
        {"find_unused_parameters": 1},
        {"gradient_as_bucket_view": "yes"},
        {"bucket_cap_mb": 0},
        {"start_method": "thread"},
        {"mixed_precision": object()},
        {"ddp_comm_hook": print},
        {"model_averaging_period": 4},
        {"bucket_cap": 4},
        {"exchange": "ring"},
        {"exchange": "split", "compressor": "randomk"},
        {"compact_indices": "yes"},
    ],
)
def test_bad_arguments_rejected_like_the_trainer_strategy(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as trainer_error:
        SparseDDPStrategy(**kwargs)
    with pytest.raises(ValueError) as fabric_error:
        FabricSparseDDPStrategy(**kwargs)
    assert str(fabric_error.value) == str(trainer_error.value)
    name = next(iter(kwargs))
    assert str(fabric_error.value).startswith(f"{name}="), "the message names the argument and its value"
    assert "not allowed" in str(fabric_error.value)


LOCAL = {**UPDATE, "sync_every": 4, "outer_optimizer": "nesterov", "value_bits": 4}
STREAMING = {**UPDATE, "sync_every": 4, "sync_delay": 1, "fragments": 2, "value_bits": 2, "warmup_steps": 0}


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fabric_local")
    return run_fabric(
        {
            "steps": 30,
            "optimizer": "adamw",
            "lr": 0.01,
            "runs": [
                # the checkpoint after step 14: two local steps into a cycle of four
                {"name": "local", "strategy": LOCAL, "save_at": 14, "save_to": str(root / "local.ckpt")},
                {"name": "local_resumed", "strategy": LOCAL, "resume_from": str(root / "local.ckpt")},
                # fragment a launches at steps 2, 6, 10, 14, ...: the checkpoint after step 14 has it in flight
                {"name": "streaming", "strategy": STREAMING, "save_at": 14, "save_to": str(root / "stream.ckpt")},
                {"name": "streaming_resumed", "strategy": STREAMING, "resume_from": str(root / "stream.ckpt")},
            ],
        },
        root,
    )


@pytest.mark.dist
def test_local_steps_with_an_outer_optimizer(local_runs: dict[str, Any]) -> None:
    full, resumed = local_runs["local"], local_runs["local_resumed"]
    assert_identical_replicas(full, sync_every=4)
    for f, r in zip(full, resumed, strict=True):
        assert f["hook_step"] == r["hook_step"] == 30 // 4  # one exchange every 4 optimizer steps
        assert f["final_acc"] > f["initial_acc"] + 0.15, (f["initial_acc"], f["final_acc"])
        assert r["after_step"] == f["after_step"][14:]
        for key, value in f["params"].items():
            assert torch.equal(value, r["params"][key]), key
        for key, value in f["residuals"].items():
            assert torch.equal(value, r["residuals"][key]), key


@pytest.mark.dist
def test_delayed_fragments_in_a_fabric_loop(local_runs: dict[str, Any]) -> None:
    """sync_delay=1 and 2 fragments in a user's loop: one global model at the end, the model learns,
    and a run resumed from a checkpoint written with an exchange in flight ends on the same bits."""
    full, resumed = local_runs["streaming"], local_runs["streaming_resumed"]
    a, b = full
    for key, value in a["params"].items():
        assert torch.equal(value, b["params"][key]), key
    for f, r in zip(full, resumed, strict=True):
        assert f["final_acc"] > f["initial_acc"] + 0.15, (f["initial_acc"], f["final_acc"])
        for key, value in f["params"].items():
            assert torch.equal(value, r["params"][key]), key
        for key, value in f["residuals"].items():
            assert torch.equal(value, r["residuals"][key]), key
