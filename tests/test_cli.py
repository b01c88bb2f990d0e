"""The Lightning CLI example and every config in examples/configs/ (configs added later are covered too)."""

from __future__ import annotations

import csv
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _dist import FSDP2

from lightning_sparse import SparseDDPStrategy, SparseFSDPStrategy
from lightning_sparse.strategies.monitor import METRIC_NAMES
from lightning_sparse.strategies.presets import PRESETS

pytest.importorskip("jsonargparse")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parent.parent
# the sparse_fsdp config where this torch runs FSDP2 (2.7 and newer)
CONFIGS = [p for p in sorted((ROOT / "examples" / "configs").glob("*.yaml")) if FSDP2 or p.stem != "sparse_fsdp"]


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch) -> None:
    """Run each CLI in a fresh directory, with a command line of its own (not pytest's)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["cli.py"])


def _cli_module() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_sparse_example_cli", ROOT / "examples" / "cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _strategy_args() -> dict[str, inspect.Parameter]:
    params = inspect.signature(SparseDDPStrategy.__init__).parameters
    return {n: p for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}


def test_there_are_configs() -> None:
    every = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
    assert {"topk", "randomk", "sparse_ddp", "sparse_fsdp"} <= {p.stem for p in every}
    texts = [p.read_text() for p in every]
    assert any("strategy: sparse_ddp" in t for t in texts)
    assert any("class_path: lightning_sparse.SparseDDPStrategy" in t for t in texts)
    assert any("class_path: lightning_sparse.SparseFSDPStrategy" in t for t in texts)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_into_the_configured_strategy(config: Path) -> None:
    cli = _cli_module().main(["--config", str(config)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, (SparseDDPStrategy, SparseFSDPStrategy))
    assert cli.trainer.num_devices == 2
    spec = yaml.safe_load(config.read_text())["trainer"]["strategy"]
    if isinstance(strategy, SparseFSDPStrategy):  # the sharding arguments reached it
        assert strategy.sharded_modules == spec["init_args"]["sharded_modules"]
        assert strategy._shard_size == spec["init_args"]["shard_size"]
    if isinstance(spec, dict):  # class_path / init_args: every value given reached the strategy
        state = strategy.sparse_state
        args = spec.get("init_args", {})
        compressor = args.get("compressor")
        if isinstance(compressor, str):
            assert type(state.compressor).name == compressor.lower()
        elif isinstance(compressor, dict):
            assert type(state.compressor).__name__ == compressor["class_path"].rsplit(".", 1)[-1]
            for key, value in compressor.get("init_args", {}).items():
                assert state.compressor.config()[key] == value
        density = args.get("density")
        if isinstance(density, float):
            assert state.schedule.density(10_000) == density
        elif isinstance(density, dict):
            assert type(state.schedule).__name__ == density["class_path"].rsplit(".", 1)[-1]
        for key in ("error_feedback", "min_numel", "warmup_steps", "seed", "sync_every", "sync_delay", "fragments"):
            if key in args:
                assert getattr(state.config, key) == args[key], key
        fallback = args.get("fallback_to_dense", True)
        if isinstance(fallback, dict):
            assert type(state.config.timed_fallback).__name__ == fallback["class_path"].rsplit(".", 1)[-1]
            assert state.config.timed_fallback.config() == {
                **state.config.timed_fallback.config(),
                **fallback.get("init_args", {}),
            }
        else:
            assert state.config.byte_rule == (fallback is not False)
            assert (state.config.timed_fallback is not None) == (fallback == "time")
        if args.get("value_dtype") is not None:
            assert str(state.config.value_dtype) == f"torch.{args['value_dtype']}"
        if "compression_monitor" in args:
            assert strategy.compression_monitor == args["compression_monitor"]
    if isinstance(spec, str) and spec.removeprefix("sparse_ddp_") in PRESETS:  # a preset by name reached it
        settings = strategy.sparse_state.config
        for key, value in PRESETS[spec.removeprefix("sparse_ddp_")].items():
            got = settings.schedule.density(0) if key == "density" else getattr(settings, key)
            assert key == "outer_optimizer" or got == value, key
    for callback in yaml.safe_load(config.read_text())["trainer"].get("callbacks", []):  # each one reached it
        name = callback["class_path"].rsplit(".", 1)[-1]
        assert any(type(cb).__name__ == name for cb in cli.trainer.callbacks), name


@pytest.mark.dist
def test_configs_fit_on_two_processes(tmp_path: Path) -> None:
    """One 2-process launch fits from every config in turn (popen launcher, under a timeout)."""
    from lightning_sparse._utils import free_port

    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    env.pop("LOCAL_RANK", None)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "cli_worker.py"), str(tmp_path), *map(str, CONFIGS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120 + 60 * len(CONFIGS),
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    for config in CONFIGS:
        with open(tmp_path / config.stem / "csv" / "version_0" / "metrics.csv", newline="") as f:
            rows = [row for row in csv.DictReader(f) if row.get("sparse/compression_ratio")]
        assert rows, f"{config.stem}: no compression figures logged"
        assert max(int(row["step"]) for row in rows) == 8, config.stem  # it ran the 9 steps
        for row in rows:
            for name in METRIC_NAMES:
                assert float(row[name]) >= 0, (config.stem, name)
        assert float(rows[-1]["sparse/compression_ratio_cumulative"]) > 1, config.stem
    # one summary per fit; every config compresses updates (the default) except dgc.yaml (momentum correction)
    assert proc.stdout.count("Sparse update communication:") == len(CONFIGS) - 1
    assert proc.stdout.count("Sparse gradient communication:") == 1


def test_print_config_shows_every_strategy_and_compressor_argument(capsys) -> None:
    config = ROOT / "examples" / "configs" / "topk.yaml"
    with pytest.raises(SystemExit) as exit_info:
        _cli_module().main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_sparse.SparseDDPStrategy"
    given = yaml.safe_load(config.read_text())["trainer"]["strategy"]["init_args"]
    args = strategy["init_args"]
    for name, param in _strategy_args().items():
        assert name in args, name
        if name not in given and isinstance(param.default, (bool, int, float, str, type(None))):
            assert args[name] == param.default, name
    assert args["compressor"] == {"class_path": "lightning_sparse.compressors.TopK", "init_args": {"fast": True}}


def test_topk_config_lists_every_strategy_argument_with_its_default(capsys) -> None:
    """docs/cli.md shows topk.yaml as the config with every argument: its init_args are the strategy's
    arguments, in the signature's order, each at its default (the compressor as the class of the default
    name, with that class's defaults), and the CLI reads them back unchanged."""
    import importlib

    from lightning_sparse.compressors import get_compressor

    config = ROOT / "examples" / "configs" / "topk.yaml"
    given = yaml.safe_load(config.read_text())["trainer"]["strategy"]["init_args"]
    params = _strategy_args()
    assert list(given) == list(params), f"missing: {set(params) - set(given)}, unknown: {set(given) - set(params)}"
    for name, param in params.items():
        value = given[name]
        if name == "compressor":
            module, _, cls = value["class_path"].rpartition(".")
            default = get_compressor(param.default)
            assert getattr(importlib.import_module(module), cls) is type(default)
            assert value.get("init_args", {}) == default.config()
        elif name == "timeout":  # a timedelta, written as the CLI prints it
            assert value == str(param.default)
        else:
            assert value == param.default and type(value) is type(param.default), (name, value, param.default)
    with pytest.raises(SystemExit):
        _cli_module().main(["fit", "--config", str(config), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]["init_args"] == given


def test_strategy_help_shows_type_and_default_of_every_argument(capsys) -> None:
    with pytest.raises(SystemExit):
        _cli_module().main(["fit", "--trainer.strategy.help", "lightning_sparse.SparseDDPStrategy"])
    text = " ".join(capsys.readouterr().out.split())  # undo the help formatter's line wrapping
    text = text.split("Help for --trainer.strategy.help=lightning_sparse.SparseDDPStrategy", 1)[1]  # past usage
    option = r"--trainer\.strategy\.(\w+) \S+(?:, --trainer\.strategy\.\w+\+ \S+)? "  # name, metavar, alias
    described = {m.group(1): m.group(2) for m in re.finditer(option + r"(.*?)(?= --trainer\.strategy\.|\Z)", text)}
    for name in _strategy_args():
        assert re.search(r"\(type: .+, default: ", described.get(name, "")), name
    assert "type: str | Compressor, default: topk" in text
    assert "type: float | DensitySchedule, default: 0.01" in text
    assert "type: bool, default: True" in text


def test_a_command_line_option_overrides_the_config(capsys) -> None:
    """`--trainer.strategy.init_args.density 0.05` on top of a config, as the docs show."""
    config = ROOT / "examples" / "configs" / "topk.yaml"
    with pytest.raises(SystemExit):
        _cli_module().main(
            ["fit", "--config", str(config), "--trainer.strategy.init_args.density", "0.05", "--print_config"]
        )
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["init_args"]["density"] == 0.05


def test_compressor_help_shows_its_arguments(capsys) -> None:
    """`--trainer.strategy.compressor.help TopK`, as the docs show."""
    config = ROOT / "examples" / "configs" / "topk.yaml"
    with pytest.raises(SystemExit):
        _cli_module().main(["fit", "--config", str(config), "--trainer.strategy.compressor.help", "TopK"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Help for --compressor.help=lightning_sparse.TopK" in text
    assert "--compressor.fast {true,false}" in text and "(type: bool, default: True)" in text


def test_chunk_topk_by_name_or_class_on_the_command_line() -> None:
    """``--trainer.strategy.init_args.compressor chunk_topk`` (a registered name) or ``ChunkTopK``
    with its ``chunk`` on top of a config, and the compressor's own help."""
    from lightning_sparse import ChunkTopK

    config = str(ROOT / "examples" / "configs" / "randomk.yaml")
    option = "--trainer.strategy.init_args.compressor"
    cli = _cli_module().main(["--config", config, option, "chunk_topk"], run=False)
    assert cli.trainer.strategy.sparse_state.compressor == ChunkTopK()
    cli = _cli_module().main(["--config", config, option, "ChunkTopK", f"{option}.chunk", "256"], run=False)
    assert cli.trainer.strategy.sparse_state.compressor == ChunkTopK(chunk=256)


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_subcommand_help_points_at_the_strategy_help(subcommand: str, capsys) -> None:
    """``fit --help`` shows the strategy as a type only; its last lines say where its arguments are."""
    with pytest.raises(SystemExit):
        _cli_module().main([subcommand, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--trainer.strategy.help lightning_sparse.SparseDDPStrategy" in out


def test_a_config_with_several_mistakes_names_them_all(tmp_path: Path) -> None:
    """A mistyped compressor does not hide the next mistake: both are named in one error."""
    from lightning_sparse import SparseConfig

    with pytest.raises(ValueError) as caught:
        SparseConfig(compressor="topkk", density=2.0, sync_every=0)
    message = str(caught.value)
    assert message.startswith("3 arguments are not allowed")
    for name in ("compressor='topkk'", "density=2.0", "sync_every=0"):
        assert name in message
    with pytest.raises(ValueError, match=r"^density=2.0 is not allowed"):  # one mistake: its own message
        SparseConfig(density=2.0)
