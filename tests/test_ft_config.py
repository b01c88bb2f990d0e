"""Fault tolerance's settings: validation at construction, the errors that name what to set, data sharding."""

from __future__ import annotations

import sys

import pytest
from _dist import FSDP2_FT, skip_without_ft

from lightning_sparse import SparseDDPStrategy
from lightning_sparse.config import SparseConfig
from lightning_sparse.exchange.ft_env import ReplicaGroupEnv, require_torchft, shard_across_groups
from lightning_sparse.exchange.update import UpdateExchange
from lightning_sparse.fabric import SparseDDPStrategy as FabricSparseDDPStrategy
from lightning_sparse.fabric.fsdp import SparseFSDPStrategy as FabricSparseFSDPStrategy
from lightning_sparse.strategies.core import SparseCore
from lightning_sparse.strategies.fsdp import SparseFSDPStrategy

ENV = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510", "REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "3"}


@pytest.fixture
def ft_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)


def test_the_environment_is_read_and_every_missing_variable_is_named() -> None:
    assert ReplicaGroupEnv.read(ENV) == ReplicaGroupEnv("http://127.0.0.1:29510", 2, 3)
    for missing in ENV:
        with pytest.raises(ValueError, match=f"needs the environment variable {missing}"):
            ReplicaGroupEnv.read({k: v for k, v in ENV.items() if k != missing})
    with pytest.raises(
        ValueError, match="REPLICA_GROUP_ID=3 is not allowed with NUM_REPLICA_GROUPS=3: expected 0 to 2"
    ):
        ReplicaGroupEnv.read({**ENV, "REPLICA_GROUP_ID": "3"})
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID='two' is not allowed: expected a whole number"):
        ReplicaGroupEnv.read({**ENV, "REPLICA_GROUP_ID": "two"})
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE='127.0.0.1:29510' is not allowed: expected an address"):
        ReplicaGroupEnv.read({**ENV, "TORCHFT_LIGHTHOUSE": "127.0.0.1:29510"})


@pytest.mark.parametrize("shell", [SparseDDPStrategy, FabricSparseDDPStrategy], ids=["trainer", "fabric"])
def test_a_missing_variable_fails_at_construction(shell: type, monkeypatch: pytest.MonkeyPatch) -> None:
    skip_without_ft()
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE"):
        shell(fault_tolerant=True, sync_every=4)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", ENV["TORCHFT_LIGHTHOUSE"])
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "3")
    with pytest.raises(ValueError, match="needs the environment variable REPLICA_GROUP_ID"):
        shell(fault_tolerant=True, sync_every=4)


def test_without_torchft_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch, ft_env: None) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lightning_sparse\[ft\]'"):
        require_torchft()
    with pytest.raises(ImportError, match=r"lightning_sparse\[ft\]"):
        SparseConfig(fault_tolerant=True)


def test_a_torch_before_2_8_is_refused(monkeypatch: pytest.MonkeyPatch, ft_env: None) -> None:
    pytest.importorskip("torchft")  # on any torch: the version is set below
    monkeypatch.setattr("torch.__version__", "2.7.1+cu126")  # torchft 0.2 sets gloo options 2.7 lacks
    with pytest.raises(RuntimeError, match=r"fault_tolerant=True needs torch >= 2\.8 .*this is torch 2\.7\.1\+cu126"):
        SparseConfig(fault_tolerant=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fault_tolerant": "yes"}, "fault_tolerant='yes' is not allowed: expected True or False"),
        ({"min_replicas": 0}, "min_replicas=0 is not allowed: expected a whole number >= 1"),
        ({"quorum_timeout": 0}, "quorum_timeout=0 is not allowed: expected a number of seconds > 0"),
        (
            {"fault_tolerant": True, "compress": "gradient"},
            "fault_tolerant=True is not allowed with compress='gradient'",
        ),
        ({"fault_tolerant": True, "fallback_to_dense": "time"}, "not allowed with fallback_to_dense='time'"),
    ],
)
def test_bad_settings_are_refused_naming_the_argument(kwargs: dict, message: str, ft_env: None) -> None:
    skip_without_ft()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        SparseConfig(**kwargs)


@pytest.mark.skipif(not FSDP2_FT, reason="sparse_fsdp under fault tolerance needs torch >= 2.10")
@pytest.mark.parametrize("shell", [SparseFSDPStrategy, FabricSparseFSDPStrategy], ids=["trainer", "fabric"])
def test_sparse_fsdp_under_fault_tolerance_refuses_a_shard_size(shell: type) -> None:
    with pytest.raises(ValueError, match=r"shard_size=2 is not allowed with fault_tolerant=True: expected None"):
        shell(fault_tolerant=True, sync_every=4, shard_size=2)


def test_fault_tolerant_strategies_build_their_exchange_on_torchft(ft_env: None) -> None:
    skip_without_ft()
    from lightning_sparse.exchange.ft import ReplicaCommit

    fsdp = (SparseFSDPStrategy, FabricSparseFSDPStrategy) if FSDP2_FT else ()
    for shell in (SparseDDPStrategy, FabricSparseDDPStrategy, *fsdp):
        strategy = shell(fault_tolerant=True, sync_every=4, value_bits=2, min_replicas=2, quorum_timeout=5.0)
        update = strategy.update_exchange
        assert type(update) is UpdateExchange and isinstance(update.commit, ReplicaCommit)
        assert (update.commit.min_replicas, update.commit.quorum_timeout, update.active) == (2, 5.0, True)
    off = SparseCore(SparseConfig(sync_every=4))
    assert off.update is not None and off.update.commit is None  # fault_tolerant=False: the exchange as it was


def test_the_sampler_shards_over_every_group_then_the_rank_inside(ft_env: None) -> None:
    # REPLICA_GROUP_ID 2 of 3, 2 processes per group: global shards 4 and 5 of 6 (torchft's DistributedSampler)
    assert shard_across_groups({"num_replicas": 2, "rank": 0}, True) == {"num_replicas": 6, "rank": 4}
    assert shard_across_groups({"num_replicas": 2, "rank": 1}, True) == {"num_replicas": 6, "rank": 5}
    assert shard_across_groups({"num_replicas": 2, "rank": 1}, False) == {"num_replicas": 2, "rank": 1}
