"""Construction, validation and registration of SparseDDPStrategy (no processes needed)."""

from __future__ import annotations

import importlib
import pickle

import pytest
import torch
from _dist import FSDP2
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_sparse
from lightning_sparse import ConstantDensity, RandomK, SparseDDPStrategy, TopK


def test_registers_names_idempotently() -> None:
    names = {"sparse_ddp", "sparse_ddp_spawn", "sparse_ddp_find_unused_parameters_true"}
    assert names <= set(StrategyRegistry)
    importlib.reload(lightning_sparse)  # importing / registering twice is fine
    lightning_sparse.register_strategies()
    for name in names:
        assert StrategyRegistry[name]["strategy"].__name__ == "SparseDDPStrategy"
    assert StrategyRegistry["sparse_ddp_spawn"]["init_params"]["start_method"] == "spawn"
    assert StrategyRegistry["sparse_ddp_find_unused_parameters_true"]["init_params"]["find_unused_parameters"]


def test_defaults_and_ddp_kwargs() -> None:
    s = SparseDDPStrategy()
    assert isinstance(s, DDPStrategy)
    st = s.sparse_state
    assert isinstance(st.compressor, TopK) and st.schedule.density(0) == 0.01
    assert st.config.error_feedback and st.config.warmup_steps == 1 and st.config.value_dtype is None
    s = SparseDDPStrategy(compressor=RandomK(), density=ConstantDensity(0.1), static_graph=True, bucket_cap_mb=5)
    assert isinstance(s.sparse_state.compressor, RandomK)
    assert s._ddp_kwargs["static_graph"] is True and s._ddp_kwargs["bucket_cap_mb"] == 5
    assert SparseDDPStrategy(value_dtype="bfloat16").sparse_state.config.value_dtype is torch.bfloat16
    assert SparseDDPStrategy(value_dtype=torch.float16).sparse_state.config.value_dtype is torch.float16


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"density": 0.0}, r"density=0.0 is not allowed: expected a number in \(0, 1\]"),
        ({"density": 1.5}, r"density=1.5 is not allowed"),
        ({"density": -0.1}, r"density=-0.1 is not allowed"),
        ({"density": "dense"}, r"density='dense' is not allowed"),
        ({"compressor": "zip"}, r"compressor='zip' is not allowed: .*'randomk'.*'topk'"),
        ({"compressor": 3}, r"compressor=3 is not allowed"),
        ({"min_numel": -1}, r"min_numel=-1 is not allowed: expected an integer >= 0"),
        ({"min_numel": 1.5}, r"min_numel=1.5 is not allowed: expected an integer"),
        ({"warmup_steps": 0, "compress": "gradient"}, r"warmup_steps=0 is not allowed: expected an integer >= 1"),
        ({"warmup_steps": -1}, r"warmup_steps=-1 is not allowed: expected an integer >= 0"),
        ({"seed": -3}, r"seed=-3 is not allowed"),
        ({"value_dtype": "int8"}, r"value_dtype='int8' is not allowed: expected None or one of"),
        ({"value_dtype": torch.float64}, r"value_dtype=torch.float64 is not allowed"),
        ({"error_feedback": "yes"}, r"error_feedback='yes' is not allowed: expected True or False"),
        ({"fallback_to_dense": 1}, r"fallback_to_dense=1 is not allowed"),
        ({"momentum_correction": 1.0}, r"momentum_correction=1.0 is not allowed: expected a number in \[0, 1\)"),
        ({"momentum_correction": -0.5}, r"momentum_correction=-0.5 is not allowed"),
        ({"momentum_correction": True}, r"momentum_correction=True is not allowed"),
        ({"static_graph": "no"}, r"static_graph='no' is not allowed"),
        ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0 is not allowed"),
        ({"start_method": "thread"}, r"start_method='thread' is not allowed"),
        ({"mixed_precision": object()}, r"mixed_precision=.* is not allowed with SparseDDPStrategy: DDP's mixed"),
        ({"ddp_comm_hook": print}, r"ddp_comm_hook=.* is not allowed with SparseDDPStrategy"),
        ({"model_averaging_period": 4}, r"model_averaging_period=4 is not allowed"),
        # update mode builds no DDP: an argument of DDP's reducer alone would do nothing
        ({"delay_all_reduce_named_params": []}, r"delay_all_reduce_named_params=\[\] is not allowed with compress='u"),
        ({"check_reduction": True}, r"check_reduction=True is not allowed with compress='update': update mode builds"),
        # a misspelt argument is refused here, not by DistributedDataParallel at setup
        ({"bucket_cap": 4}, r"bucket_cap=4 is not allowed: it is an argument of neither SparseDDPStrategy nor"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        SparseDDPStrategy(**kwargs)


def test_update_mode_takes_the_ddp_arguments_its_replicas_honour() -> None:
    from lightning_sparse.strategies.core import SparseCore

    s = SparseDDPStrategy(broadcast_buffers=False, init_sync=False, forward_sync_buffers=None)
    assert s._ddp_kwargs["broadcast_buffers"] is False and s._ddp_kwargs["init_sync"] is False
    assert isinstance(s._core, SparseCore) and s._core.replicated
    assert not SparseDDPStrategy(compress="gradient", check_reduction=True)._core.replicated  # DDP's there


def test_update_mode_takes_init_sync_where_ddp_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_sparse.strategies import ddp_args

    class OlderDDP(DistributedDataParallel):  # torch before 2.5: no init_sync
        def __init__(self, module: torch.nn.Module, broadcast_buffers: bool = True) -> None:
            super().__init__(module, broadcast_buffers=broadcast_buffers)

    monkeypatch.setattr(ddp_args, "DistributedDataParallel", OlderDDP)
    assert SparseDDPStrategy(init_sync=False)._ddp_kwargs["init_sync"] is False  # the replicas take it
    with pytest.raises(ValueError, match=r"init_sync=False is not allowed: .*which takes broadcast_buffers\."):
        SparseDDPStrategy(compress="gradient", init_sync=False)  # DDP would get it


@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_a_torch_before_2_7_is_refused_at_construction(front: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_sparse import FabricSparseFSDPStrategy, SparseFSDPStrategy

    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")  # FSDP2 public, but not on CPUs yet
    strategy = SparseFSDPStrategy if front == "trainer" else FabricSparseFSDPStrategy
    with pytest.raises(RuntimeError, match=r"SparseFSDPStrategy needs torch >= 2\.7 .*this is torch 2\.6\.0\+cpu"):
        strategy()
    monkeypatch.setattr(torch, "__version__", "2.7.0")
    strategy()
    with pytest.raises(RuntimeError, match=r">= 2\.10 with fault_tolerant=True .*this is torch 2\.7\.0"):
        strategy(fault_tolerant=True)


def test_none_for_a_conflicting_ddp_argument_means_none() -> None:
    # the Lightning CLI passes DDPStrategy's own arguments, None when not given
    s = SparseDDPStrategy(ddp_comm_hook=None, ddp_comm_state=None, model_averaging_period=None)
    assert "ddp_comm_hook" not in s._ddp_kwargs


def test_state_pickles_for_spawn() -> None:
    s = SparseDDPStrategy(compressor="randomk", density=0.05)
    params = [("w", torch.nn.Parameter(torch.zeros(2000)))]
    s.sparse_state.bind(params)
    s.sparse_state.memory.accumulate("w", torch.ones(2000))
    clone = pickle.loads(pickle.dumps(s.sparse_state))
    assert clone.process_group is None and clone._names == {}
    assert torch.equal(clone.memory.get("w"), torch.ones(2000))
    assert isinstance(clone.compressor, RandomK) and clone.schedule.density(0) == 0.05


def test_trainer_resolves_strategy_name() -> None:
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", devices=2, strategy="sparse_ddp", logger=False)
    assert isinstance(trainer.strategy, SparseDDPStrategy)
    assert trainer.strategy._start_method == "popen"
    trainer = Trainer(accelerator="cpu", devices=2, strategy="sparse_ddp_find_unused_parameters_true", logger=False)
    assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is True


def test_presets_by_name_and_by_call_in_every_front_end() -> None:
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer

    from lightning_sparse.strategies.presets import PRESETS

    for name, settings in PRESETS.items():
        trainer = Trainer(accelerator="cpu", devices=2, strategy=f"sparse_ddp_{name}", logger=False)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=f"sparse_ddp_{name}")
        for strategy in (trainer.strategy, fabric.strategy):
            config = strategy.sparse_state.config  # type: ignore[attr-defined]
            got = {k: getattr(config, k) for k in settings if k not in ("outer_optimizer", "density")}
            assert got == {k: v for k, v in settings.items() if k not in ("outer_optimizer", "density")}
            assert config.schedule.density(0) == settings.get("density", 0.01)
    if FSDP2:  # a preset with arguments on top, in the FSDP2 front ends too
        strategy = lightning_sparse.SparseFSDPStrategy.preset("4000x", shard_size=2, density=0.02)
        config = strategy.sparse_state.config
        assert (config.sync_every, config.value_bits, config.flush_at_end) == (16, 2, 4)
        assert config.schedule.density(0) == 0.02
        assert lightning_sparse.FabricSparseFSDPStrategy.preset("1000x").sparse_state.config.sync_every == 4
    with pytest.raises(
        ValueError,
        match=r"preset='10x' is not allowed: expected one of \['1000x', '2000x', '4000x', '8000x', '10000x'\]",
    ):
        SparseDDPStrategy.preset("10x")
