"""``sparse_fsdp`` with the Trainer on real gloo processes (tests/fsdp_worker.py): 4 processes as 2
groups of 2 (sparse HSDP), 2 as 2 groups of 1 (must end where ``sparse_ddp`` ends; the end-of-fit
hand-over adds the mean residual), 2 as one group of 2 (plain FSDP2), exact resume mid-cycle, a GPT
with tied embeddings held in ``self.model`` (fit, then validate, test and predict on the same
Trainer), and the errors at construction and setup."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import GROUP_BYTES, needs_fsdp2
from conftest import run_trainer

from lightning_sparse import SparseFSDPStrategy, TimedFallback

pytestmark = needs_fsdp2

SPARSE = {"min_numel": 256, "density": 0.05}
LOCAL = {**SPARSE, "sync_every": 4, "value_bits": 2, "warmup_steps": 0}


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hsdp")
    shard = {"shard_size": 2, "sharded_modules": ["Block"]}
    ckpt = str(root / "mid.ckpt")
    local = {**LOCAL, **shard}
    epochs = {"steps": 14, "samples": 192, "validate": True, "args": {**LOCAL, **shard}}
    config = {
        "devices": 4,
        "runs": [
            {"name": "default", "steps": 16, "validate": True, "args": {**SPARSE, **shard}},
            {"name": "own_sharding", "steps": 16, "self_sharded": True, "args": {**SPARSE, "shard_size": 2}},
            # what users already do: gradient clipping, bf16, local steps with 2-bit values
            {"name": "clip_bf16", "steps": 16, "gradient_clip_val": 0.5, "precision": "bf16-mixed", "args": local},
            # exact resume in the middle of a 4-step cycle, saved at the end of the first epoch (192
            # samples: 6 batches of 8 per process; validation at every epoch's end, as Lightning's loops
            # resume an epoch-end checkpoint exactly only then)
            {"name": "full", **epochs, "save_at_epoch_end": ckpt},
            {"name": "resumed", **epochs, "resume_from": ckpt},
        ],
    }  # fmt: skip
    return {"root": root, **run_trainer(config, root / "runs", timeout=600, worker="fsdp_worker.py")}


def _by_coords(results: list[dict[str, Any]]) -> dict[tuple[int, ...], dict[str, Any]]:
    return {tuple(r["coords"]): r for r in results}


@pytest.mark.dist
@pytest.mark.parametrize("run", ["default", "own_sharding", "clip_bf16", "full"])
def test_shards_of_one_index_are_identical_across_groups(hsdp: dict[str, Any], run: str) -> None:
    ranks = _by_coords(hsdp[run])
    assert sorted(ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for shard in (0, 1):
        a, b = ranks[(0, shard)], ranks[(1, shard)]
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), f"{run}: shard {shard} of {name} differs"
    # inside a group the processes hold different rows of the same parameters
    first, second = ranks[(0, 0)]["params"], ranks[(0, 1)]["params"]
    assert any(not torch.equal(first[n], second[n]) for n in first if first[n].shape == second[n].shape)
    for r in hsdp[run]:
        assert r["shard_size"] == 2
        assert sum(r["losses"][-4:]) < 0.8 * sum(r["losses"][:4]), r["losses"]
        t = r["telemetry"]
        assert 0 < t["sent_bytes"] < t["dense_bytes"]  # only the exchange across groups is counted
        # inside the group, apart: at least one all-gather and one reduce-scatter of every parameter a step,
        # half of each through a process of a group of 2 (validation adds its all-gathers)
        if GROUP_BYTES:  # counted where this torch lets FSDP2's collectives be wrapped
            assert r["group_bytes"] >= len(r["losses"]) * r["param_bytes"]
        else:
            assert r["group_bytes"] is None


@pytest.mark.dist
def test_validation_sees_one_global_model(hsdp: dict[str, Any]) -> None:
    losses = {r["val_loss"] for r in hsdp["default"]}
    assert len(losses) == 1


@pytest.mark.dist
def test_resume_mid_cycle_is_exact(hsdp: dict[str, Any]) -> None:
    full, resumed = _by_coords(hsdp["full"]), _by_coords(hsdp["resumed"])
    for coords, a in full.items():
        b = resumed[coords]
        assert b["global_step"] == a["global_step"] == 14
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), f"{coords}: {name} differs after resume"
        for name in a["residuals"]:
            assert torch.equal(a["residuals"][name], b["residuals"][name]), f"{coords}: residual {name}"
        assert a["losses"][6:] == b["losses"], coords
    folder = hsdp["root"] / "mid.ckpt.sparse"
    assert sorted(p.name for p in folder.iterdir()) == [f"rank0000{r}-of-00004.pt" for r in range(4)]
    assert (hsdp["root"] / "mid.ckpt").is_dir()  # the global model: a torch.distributed.checkpoint folder


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A GPT with tied input/output embeddings in ``self.model``, called with keyword arguments
    (``self.model(input_ids=x, labels=x).loss``) from every step, as Hugging Face models are: 4
    processes in 2 groups of 2; 8 steps, a validation after step 4 (epochs of 4 batches) and at the
    end, then validate, test, validate and predict on the same Trainer."""
    root = tmp_path_factory.mktemp("fsdp_gpt")
    shard = {"shard_size": 2, "sharded_modules": ["GPTBlock"]}
    base = {"model": "gpt", "steps": 8, "samples": 128, "validate": True, "evaluate": True}
    config = {
        "devices": 4,
        "runs": [
            {"name": "submodule", **base, "args": {**SPARSE, **shard}},
            {"name": "submodule_local", **base, "args": {**LOCAL, **shard}},
            # configure_model shards the blocks, then the LightningModule itself (docs/sharding.md)
            {"name": "own_sharding", **base, "self_sharded": True, "args": {**SPARSE, "shard_size": 2}},
            {"name": "self_call", **base, "call": "self", "args": {**SPARSE, **shard}},
        ],
    }
    return run_trainer(config, root, timeout=600, worker="fsdp_worker.py")


@pytest.mark.dist
@pytest.mark.parametrize("run", ["submodule", "submodule_local", "own_sharding", "self_call"])
def test_gpt_in_a_submodule_fits_then_validates_tests_and_predicts(gpt: dict[str, Any], run: str) -> None:
    ranks = gpt[run]
    whole = ranks[0]["full"]
    for r in ranks:
        assert r["global_step"] == 8
        for name in whole:  # the whole model, gathered: the same on every process
            assert torch.equal(r["full"][name], whole[name]), f"{run}: {name} differs"
        assert r["tied"]  # the module's tie is kept
        assert torch.equal(r["full"]["model.wte.weight"], r["full"]["model.lm_head.weight"])
        assert sum(r["losses"][-2:]) < 0.9 * sum(r["losses"][:2]), r["losses"]
        assert 0 < r["telemetry"]["sent_bytes"] < r["telemetry"]["dense_bytes"]
        # one global model seen by every stage: the same figures on every process and stage
        assert r["val_loss"] == r["test_loss"] == r["val_loss_again"] == ranks[0]["val_loss"]
        assert r["predictions"].shape == (16, 16)


@pytest.mark.dist
def test_gpt_ends_on_the_same_bits_however_it_is_called_or_sharded(gpt: dict[str, Any]) -> None:
    for run in ("own_sharding", "self_call"):
        for a, b in zip(gpt["submodule"], gpt[run], strict=True):
            assert a["losses"] == b["losses"], run
            for name in a["full"]:
                assert torch.equal(a["full"][name], b["full"][name]), f"{run}: {name}"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp_pairs")
    settings = {**SPARSE, "warmup_steps": 0}
    groups_of_1 = {**settings, "shard_size": 1, "sharded_modules": ["Block"]}
    config = {
        "devices": 2,
        "steps": 12,
        "runs": [
            {"name": "groups_of_1", "args": groups_of_1},
            # the same fit without the hand-over at the end: what it leaves in the residuals
            {"name": "kept", "args": {**groups_of_1, "flush_at_end": False}},
            {"name": "ddp", "strategy": "sparse_ddp", "args": settings},
            {"name": "one_group", "args": {**settings, "shard_size": 2, "sharded_modules": ["Block"]}},
            {"name": "fsdp2", "strategy": "fsdp2", "self_sharded": True},
            # rank 0's loss times NaN at step 4 (AdamW): its shards heal
            {"name": "nan", "args": groups_of_1, "nan_at": [4, 0]},
        ],
    }
    return run_trainer(config, root, timeout=600, worker="fsdp_worker.py")


@pytest.mark.dist
def test_a_process_whose_update_went_nonfinite_once_heals_its_shards(pairs: dict[str, Any]) -> None:
    nan, clean = pairs["nan"], pairs["groups_of_1"]
    # one step's updates of rank 0 dropped (one per tensor it holds), every later one exchanged again
    assert nan[0]["nonfinite_updates"] == len(nan[0]["params"]), nan[0]["nonfinite_updates"]
    assert nan[1]["nonfinite_updates"] == clean[0]["nonfinite_updates"] == 0
    for name, value in nan[0]["params"].items():  # one finite global model
        assert torch.isfinite(value).all() and torch.equal(value, nan[1]["params"][name]), name
    assert all(math.isfinite(loss) for loss in nan[0]["losses"][5:])


@pytest.mark.dist
def test_groups_of_one_end_where_sparse_ddp_ends(pairs: dict[str, Any]) -> None:
    for a, b in zip(pairs["groups_of_1"], pairs["ddp"], strict=True):
        assert a["params"].keys() == b["params"].keys()
        assert a["losses"] == b["losses"]
        for name in a["params"]:  # to the bit
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert a["telemetry"]["sent_bytes"] == b["telemetry"]["sent_bytes"]
        assert a["telemetry"]["dense_bytes"] == b["telemetry"]["dense_bytes"]
        assert a["group_bytes"] == (0 if GROUP_BYTES else None) and b["group_bytes"] is None  # nothing inside


@pytest.mark.dist
def test_the_hand_over_at_the_end_of_fit_adds_the_mean_residual(pairs: dict[str, Any]) -> None:
    # the default (flush_at_end=True) hands over exactly what the same fit without it leaves unsent
    kept, flushed = pairs["kept"], pairs["groups_of_1"]
    assert any(bool(e.any()) for e in kept[0]["residuals"].values())
    for name, old in kept[0]["params"].items():
        assert torch.equal(old, kept[1]["params"][name]), name  # one global model before
        e = [r["residuals"].get(name, torch.zeros(old.numel())).view_as(old) for r in kept]
        for r in flushed:
            assert torch.equal(r["params"][name], old + (e[0] + e[1]) / 2), name
    for r, k in zip(flushed, kept, strict=True):  # nothing left unsent; one float32 all-reduce counted
        assert all(not bool(e.any()) for e in r["residuals"].values())
        # (after the one-value all-reduce that finds residuals unsent)
        assert r["telemetry"]["sent_bytes"] - k["telemetry"]["sent_bytes"] == r["param_bytes"] + 4


@pytest.mark.dist
def test_one_group_is_plain_fsdp2(pairs: dict[str, Any]) -> None:
    for a, b in zip(pairs["one_group"], pairs["fsdp2"], strict=True):
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert a["telemetry"]["sent_bytes"] == 0  # nothing to exchange: one group


# ---------------------------------------------------------------------- no processes needed


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"compress": "gradient"}, r"compress='gradient' is not allowed with SparseFSDPStrategy"),
        ({"fallback_to_dense": "time"}, r"fallback_to_dense='time' is not allowed"),
        ({"fallback_to_dense": TimedFallback()}, r"fallback_to_dense=TimedFallback.* is not allowed"),
        ({"momentum_correction": 0.9}, r"momentum_correction=0.9 is not allowed"),
        ({"shard_size": 0}, r"shard_size=0 is not allowed: expected an int >= 1 or None"),
        ({"shard_size": True}, r"shard_size=True is not allowed"),
        ({"sharded_modules": "Block"}, r"sharded_modules='Block' is not allowed"),
        ({"sharded_modules": []}, r"sharded_modules=\[\] is not allowed"),
        ({"density": 2.0}, r"density"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SparseFSDPStrategy(**kwargs)


def test_registered_and_configured() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["sparse_fsdp"]["strategy"] is SparseFSDPStrategy
    strategy = SparseFSDPStrategy(shard_size=2, sharded_modules=["Block"], sync_every=4, value_bits=2)
    assert strategy.compress == "update" and strategy.sparse_state.config.sync_every == 4
    assert strategy.sharded_modules == ["Block"]


@pytest.mark.dist
def test_a_model_nobody_shards_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="found no module sharded with fully_shard"):
        run_trainer({"devices": 2, "steps": 2, "args": {"shard_size": 1}}, tmp_path, worker="fsdp_worker.py")


def test_sharding_units_keep_tied_parameters_in_one_unit() -> None:
    from torch import nn

    from lightning_sparse.strategies.sharding import sharding_units

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.emb.weight

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.other, self.scale = Net(), nn.Linear(4, 4), nn.Parameter(torch.ones(1))

    root = Root()
    units = sharding_units(root, ["Block"])
    # the child around the blocks is a unit; the LightningModule's own layer (other) stays in its unit
    assert units == [*root.model.blocks, root.model, root]
    # a listed module tied to a module outside it is left to the unit around both
    assert sharding_units(root, ["Block", "Embedding", "Linear"]) == [
        *(b.fc for b in root.model.blocks),
        *root.model.blocks,
        root.other,  # listed (a Linear) before the children holding the rest
        root.model,
        root,
    ]
    # children that share a parameter stay with the root, and so does a child whose parameters are all
    # in units already (the blocks' list)
    root.other.weight = root.model.blocks[0].fc.weight
    assert sharding_units(root, ["Block"]) == [root.model.blocks[1], root]


def test_settings_match_the_config() -> None:
    import inspect
    import typing

    from lightning_sparse import SparseConfig
    from lightning_sparse.config import setting_docs
    from lightning_sparse.strategies.fsdp import FSDP_SETTINGS

    params = inspect.signature(SparseFSDPStrategy.__init__).parameters
    hints = typing.get_type_hints(SparseFSDPStrategy.__init__)
    fields = typing.get_type_hints(SparseConfig)
    defaults = SparseConfig.__dataclass_fields__
    doc = " ".join((inspect.getdoc(SparseFSDPStrategy) or "").split())
    for name in FSDP_SETTINGS:
        assert params[name].default == defaults[name].default, name
        assert hints[name] == fields[name], name
        if name != "bucket_cap_mb":  # DDP's buckets do not apply: the exchange's messages do
            assert f"{name}: {' '.join(setting_docs()[name].split())}" in doc, name
    undocumented = [n for n in params if n != "self" and f" {n}: " not in doc]
    assert not undocumented
