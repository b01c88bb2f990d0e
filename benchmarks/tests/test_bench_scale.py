"""``python -m benchmarks scale`` on small sizes: measured == model, and the table's properties."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import main
from benchmarks.scale import COLUMNS, DENSE, MODEL_WORLD_SIZES, ddp_buckets, mlp_tensors, model_row
from lightning_sparse.wire import SPLIT_AUTO_RATIO, ring_all_reduce_bytes

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, int, Path]:
    tmp = tmp_path_factory.mktemp("scale")
    out, png = tmp / "scale.json", tmp / "wire_bytes.png"
    cmd = [
        sys.executable, "-m", "benchmarks", "scale", "--params", "2e6", "--measure-params", "3e5",
        "--world-sizes", "2", "4", "--timeout", "120", "--json", str(out),
    ]  # fmt: skip
    if HAS_MATPLOTLIB:
        cmd += ["--plot", str(png)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout, done.returncode, png


@pytest.mark.slow
@pytest.mark.dist
def test_measured_equals_model(small_run) -> None:
    result, table, _, _ = small_run
    assert [r["world"] for r in result["measured"]] == [2, 4]
    model = {r["world"]: r for r in result["measure_model"]["rows"]}
    for row in result["measured"]:
        for column in COLUMNS:
            want = model[row["world"]]["bytes"][column]
            assert row["bytes"][column] == pytest.approx(want, rel=1e-9, abs=0)
            assert row["bytes"][column] > 0
        assert f"| {row['world']} | measured | 0.30M |" in table
    assert result["measured_vs_model_max_rel"] <= 1e-9
    assert "measured == model at W = 2, 4" in table


@pytest.mark.slow
@pytest.mark.dist
def test_table_properties(small_run) -> None:
    result, table, _, _ = small_run
    rows = result["model"]["rows"] + result["measure_model"]["rows"] + result["measured"]
    assert sorted({r["world"] for r in result["model"]["rows"]}) == list(MODEL_WORLD_SIZES)
    for r in rows:
        b, w = r["bytes"], r["world"]
        assert b["auto"] <= b[DENSE] and b["auto bf16"] <= b["auto"]
        assert b["allgather compact"] < b["allgather int32"] and b["split compact"] < b["split int32"]
        if w >= 4:
            assert b["split int32"] < b["allgather int32"] and b["split compact"] < b["allgather compact"]
        # auto (no fallback needed here): the split where it moves at most a quarter of the all-gather's bytes
        split_wins = b["split compact"] <= SPLIT_AUTO_RATIO * b["allgather compact"]
        assert b["auto"] == (b["split compact"] if split_wins else b["allgather compact"])
        assert split_wins == (w >= 16)
    for r in result["model"]["rows"]:  # 2e6 parameters: one bucket, dense = a ring all-reduce of all of it
        assert r["bytes"][DENSE] == ring_all_reduce_bytes(r["world"], result["model"]["size"]["params"] * 4)
        assert f"| {r['world']} | model | 2.00M |" in table
    # allgather grows with W, split about flat
    first, last = result["model"]["rows"][0]["bytes"], result["model"]["rows"][-1]["bytes"]
    assert last["allgather compact"] > 100 * first["allgather compact"]
    assert last["split compact"] < 3 * first["split compact"]


@pytest.mark.slow
@pytest.mark.dist
def test_targets_and_exit_code(small_run) -> None:
    result, table, code, png = small_run
    assert [t["name"] for t in result["targets"]] == ["a", "b", "c", "d"]
    for t in result["targets"]:
        assert f"- ({t['name']}) {'PASS' if t['passed'] else 'FAIL'}: " in table
    assert code == (0 if all(t["passed"] for t in result["targets"]) else 1)
    assert result["targets"][0]["passed"]  # auto never above dense
    assert "8 not in --world-sizes" in result["targets"][3]["text"]  # (d) from the model when 8 is not measured
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_buckets_like_ddp() -> None:
    tensors = mlp_tensors(25_000_000, 6)  # 6 weights of 2041^2 (15.9 MiB) and their biases
    buckets = ddp_buckets(tensors, 25 * 1024 * 1024)
    assert [len(b.tensors) for b in buckets] == [3, 2, 2, 2, 2, 1]
    assert [name for name, _ in buckets[0].tensors] == ["layers.5.bias", "layers.5.weight", "layers.4.bias"]
    assert all(b.numel * 4 <= 25 * 1024 * 1024 for b in buckets)
    row = model_row(buckets, 0.01, 64)
    assert row["sent_as"]["auto"] == ["split"] * 6 and row["sent_as"][DENSE] == ["dense"] * 6
    # at 1024 ranks the all-gather moves more than dense; auto does not
    row = model_row(buckets, 0.01, 1024)
    assert row["bytes"]["allgather int32"] > row["bytes"][DENSE] > row["bytes"]["auto"]


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--density", "0"], "--density"),
        (["--density", "1.5"], "--density"),
        (["--world-sizes", "1"], "--world-sizes"),
        (["--world-sizes", "2", "0"], "--world-sizes"),
        (["--params", "10"], "--params"),
        (["--measure-params", "many"], "--measure-params"),
        (["--layers", "0"], "--layers"),
        (["--timeout", "0"], "--timeout"),
    ],
)
def test_argument_errors_name_the_argument(argv: list[str], option: str) -> None:
    with pytest.raises(ValueError, match=f"^{option}.* is not allowed"):
        main(["scale", *argv])


@pytest.mark.dist
def test_a_hang_is_killed_with_a_clear_error() -> None:
    # the processes cannot even start within 0.5 s: they are killed and the error says why
    with pytest.raises(RuntimeError, match=r"2 measuring processes did not finish within --timeout=0.5 s"):
        main(["scale", "--params", "2e6", "--measure-params", "3e5", "--world-sizes", "2", "--timeout", "0.5"])


def test_link_times_count_a_round_trip_per_collective() -> None:
    from benchmarks.scale.model import DENSE, LINKS, ddp_buckets, link_seconds, mlp_tensors, model_row
    from benchmarks.scale.report import format_links

    buckets = ddp_buckets(mlp_tensors(2_000_000, 4), 1 << 20)  # several buckets
    assert len(buckets) > 2
    row = model_row(buckets, 0.01, 8)
    # in DDP's hook a collective (or two) per bucket; coalesced, as many as one bucket's
    assert row["collectives"][DENSE] == len(buckets)
    assert row["collectives"]["auto"] >= len(buckets) and row["update_collectives"]["auto"] <= 2
    slow = link_seconds(row, "auto", 125e6, 0.05, update=False)
    assert slow == row["collectives"]["auto"] * 0.05 + row["bytes"]["auto"] / 125e6
    assert link_seconds(row, "auto", 125e6, 0.05, update=True) < slow
    model = {"size": {"params": sum(b.numel for b in buckets), "buckets": buckets}, "rows": [row]}
    table = format_links(model)
    assert len(table) == 5 and all(name in table[2] for name, _, _ in LINKS)
