"""One source of truth for the settings: SparseConfig, and the two strategies that take them flat."""

from __future__ import annotations

import inspect
import re
import typing

import pytest
import torch
from _dist import needs_fsdp2

from lightning_sparse import (
    FabricSparseDDPStrategy,
    FabricSparseFSDPStrategy,
    SparseConfig,
    SparseDDPStrategy,
    SparseFSDPStrategy,
    SparseState,
)
from lightning_sparse.config import setting_docs, setting_names

# The four front ends take the settings as flat keyword arguments, their signatures and argument
# docs written from SparseConfig (strategies.settings.with_settings): the Lightning CLI (jsonargparse)
# reads each strategy's signature and docstring for its types, defaults and --help.
SHELLS = [SparseDDPStrategy, FabricSparseDDPStrategy, SparseFSDPStrategy, FabricSparseFSDPStrategy]
#: the shells that can be built with this torch (the FSDP2 ones need 2.7)
BUILDABLE = [pytest.param(s, marks=needs_fsdp2) if s in SHELLS[2:] else s for s in SHELLS]
#: settings of DDP itself, which the FSDP2 strategies do not take
DDP_ONLY = {"find_unused_parameters", "static_graph", "gradient_as_bucket_view", "start_method"}


def shell_settings(shell: type) -> list[str]:
    """The settings ``shell`` takes: all of SparseConfig's, less DDP's own for the FSDP2 strategies."""
    fsdp = shell in (SparseFSDPStrategy, FabricSparseFSDPStrategy)
    return [name for name in setting_names() if not (fsdp and name in DDP_ONLY)]


def arg_docs(cls: type) -> dict[str, str]:
    """The ``Args:`` entries of a Google-style docstring, whitespace folded."""
    doc = inspect.getdoc(cls) or ""
    section = doc.split("Args:\n", 1)[1].split("\n\n", 1)[0]
    entries: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        m = re.match(r"^    (\*{0,2}\w+): (.*)$", line)
        if m:
            name = m.group(1)
            entries[name] = m.group(2)
        elif name is not None:
            entries[name] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in entries.items()}


@pytest.mark.parametrize("shell", SHELLS, ids=lambda c: c.__module__)
def test_shell_signature_matches_the_config(shell: type) -> None:
    params = inspect.signature(shell.__init__).parameters
    hints = typing.get_type_hints(shell.__init__)
    fields = typing.get_type_hints(SparseConfig)
    defaults = SparseConfig.__dataclass_fields__
    for name in shell_settings(shell):
        assert name in params, f"{shell.__qualname__} lacks the setting {name!r}"
        assert params[name].default == defaults[name].default, name
        assert hints[name] == fields[name], (name, hints[name], fields[name])


@pytest.mark.parametrize("shell", SHELLS, ids=lambda c: c.__module__)
def test_shell_argument_docs_match_the_config(shell: type) -> None:
    docs = arg_docs(shell)
    for name, doc in setting_docs().items():
        fsdp = shell in (SparseFSDPStrategy, FabricSparseFSDPStrategy)
        if name == "bucket_cap_mb" and fsdp:  # no DDP buckets there: its own words, the same default
            assert "(None: 25)" in docs[name]
        elif name in shell_settings(shell):
            assert docs.get(name) == doc, f"{shell.__qualname__}: the doc of {name!r} drifted from SparseConfig's"
    undocumented = set(inspect.signature(shell.__init__).parameters) - {"self", "kwargs"} - set(docs)
    assert not undocumented


@pytest.mark.parametrize("shell", BUILDABLE, ids=lambda c: c.__module__)
def test_shell_builds_the_config_it_was_given(shell: type) -> None:
    strategy = shell(compressor="randomk", density=0.002, value_dtype="bfloat16", exchange="allgather")
    config = strategy._core.config
    assert config == SparseConfig(
        compressor=config.compressor, density=config.density, value_dtype="bfloat16", exchange="allgather"
    )
    assert config.compressor.name == "randomk" and config.value_dtype is torch.bfloat16
    assert strategy.sparse_state.config is config


def test_defaults_are_declared_once() -> None:
    # the shells' defaults are the config's; the hook alone declares one difference, on purpose
    assert SparseDDPStrategy().compress == FabricSparseDDPStrategy().compress == SparseConfig().compress == "update"
    assert SparseState().config.compress == "gradient"
    assert SparseState(SparseConfig()).config.compress == "update"
    with pytest.raises(ValueError, match="a config or settings, not both"):
        SparseState(SparseConfig(), density=0.5)


def test_config_validates_at_construction() -> None:
    with pytest.raises(ValueError, match=r"exchange='ring' is not allowed: expected one of"):
        SparseConfig(exchange="ring")
    with pytest.raises(ValueError, match=r"compact_indices=1 is not allowed: expected True or False"):
        SparseConfig(compact_indices=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"flush_at_end='yes' is not allowed: expected True, False or an int >= 1"):
        SparseConfig(flush_at_end="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"flush_at_end=0 is not allowed"):
        SparseConfig(flush_at_end=0)
    assert SparseConfig(flush_at_end=8).flush_at_end == 8  # 8 exchanges as configured at the end of fit
    with pytest.raises(ValueError, match=r"flush_at_end=8 is not allowed with fault_tolerant=True"):
        SparseConfig(flush_at_end=8, fault_tolerant=True)
    with pytest.raises(ValueError, match=r"max_nonfinite_steps=-1 is not allowed"):
        SparseDDPStrategy(max_nonfinite_steps=-1)
    assert SparseConfig().flush_at_end and SparseConfig().max_nonfinite_steps == 8
    with pytest.raises(dataclasses_frozen()):
        SparseConfig().seed = 3  # type: ignore[misc]


def dataclasses_frozen() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_fingerprint_and_ddp_kwargs() -> None:
    a, b = SparseConfig(), SparseConfig(density=0.02)
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == SparseConfig().fingerprint()
    assert SparseConfig(compress="gradient").ddp_kwargs["gradient_as_bucket_view"] is False
    assert SparseConfig(bucket_cap_mb=4).ddp_kwargs["bucket_cap_mb"] == 4
    assert "bucket_cap_mb" not in SparseConfig().ddp_kwargs


def test_sparse_state_mirrors_no_setting() -> None:
    """Every setting has one home, the config: no property of SparseState returns one of them."""
    from lightning_sparse.config import setting_names

    state = SparseState(compress="update", compressor="topk", density=0.25, sync_every=3, value_bits=2)
    config_values = {name: getattr(state.config, name) for name in setting_names()}
    properties = [n for n, v in vars(SparseState).items() if isinstance(v, property)]
    assert properties  # step and wire: the exchange's, not settings
    for name in properties:
        assert name not in config_values, name
        value = getattr(state, name)
        assert all(value is not v for v in config_values.values() if not isinstance(v, (bool, int, type(None)))), name


def test_the_config_holds_values_and_each_state_learns_on_its_own_copy() -> None:
    """A density schedule or timed fallback given to the config describes one: binding a state sets up and
    trains that state's deep copy, so the config (shared by every process's state) is never set up."""
    import pickle

    from lightning_sparse import AdaptiveDensity, TimedFallback
    from lightning_sparse.exchange.step import bucket as exchange_bucket

    config = SparseConfig(density=AdaptiveDensity(initial_density=0.05), fallback_to_dense=TimedFallback())
    described = pickle.dumps((config.schedule, config.timed_fallback))
    params = [("w", torch.nn.Parameter(torch.randn(4096)))]
    states = [SparseState(config), SparseState(config)]
    for state in states:
        state.bind(params)
        assert state.schedule is not config.schedule and state.timed_fallback is not config.timed_fallback
        for _ in range(3):
            exchange_bucket(state, torch.randn(4096), state.plan(torch.zeros(4096), [params[0][1]])).wait()
        assert state.step == 3
    assert states[0].schedule is not states[1].schedule
    assert pickle.dumps((config.schedule, config.timed_fallback)) == described


def test_offload_global_is_checked() -> None:
    assert SparseConfig(offload_global=True).offload_global is True
    with pytest.raises(ValueError, match=r"offload_global=1 is not allowed"):
        SparseConfig(offload_global=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"offload_global=True is not allowed with compress='gradient'"):
        SparseConfig(compress="gradient", offload_global=True)


@pytest.mark.parametrize("shell", BUILDABLE, ids=lambda c: c.__module__)
def test_shell_refuses_a_name_it_does_not_take(shell: type) -> None:
    """A mistyped setting is refused by name at construction (the DDP front ends pass names that are
    not settings on to DistributedDataParallel, which checks them)."""
    with pytest.raises((TypeError, ValueError), match="densty"):
        shell(densty=0.1)
    if shell in (SparseFSDPStrategy, FabricSparseFSDPStrategy):
        with pytest.raises(TypeError, match="static_graph"):
            shell(static_graph=True)  # DDP's own: not a setting of the FSDP2 front ends


def test_settings_are_keyword_arguments_in_the_signature() -> None:
    params = inspect.signature(SparseDDPStrategy).parameters
    assert params["density"].kind is inspect.Parameter.KEYWORD_ONLY and params["density"].default == 0.01
    assert list(params)[-1] == "kwargs" and params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    fsdp = inspect.signature(SparseFSDPStrategy).parameters
    assert list(fsdp)[:2] == ["shard_size", "sharded_modules"] and "static_graph" not in fsdp


def test_the_deprecated_step_exchange_is_the_state_itself() -> None:
    state = SparseState(compressor="topk", density=0.5)
    with pytest.warns(DeprecationWarning, match="step_exchange is deprecated"):
        assert state.step_exchange is state
