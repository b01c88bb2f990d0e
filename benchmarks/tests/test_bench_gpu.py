"""The GPU step benchmark's code paths, on CPUs with a tiny GPT (figures are not asserted: machines are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks.gpu import MODELS, RUNS, build_model, format_table, profile_counts, summarise


def test_the_gpt2_model_has_gpt2_smalls_shape() -> None:
    shape = MODELS["gpt2"]
    assert (shape["width"], shape["layers"], shape["heads"], shape["batch"], shape["context"]) == (768, 12, 12, 8, 256)
    tiny = build_model("tiny")
    assert sum(1 for _ in tiny.parameters()) == 4 + 12 * MODELS["tiny"]["layers"]  # as GPT-2's 148 at 12 blocks


def test_profile_counts_per_step() -> None:
    events = [SimpleNamespace(name=n) for n in ["cudaStreamSynchronize"] * 6 + ["cudaLaunchKernel"] * 10]
    events += [SimpleNamespace(name=n) for n in ["aten::_local_scalar_dense"] * 4 + ["c10d::allreduce_", "gloo:x"]]
    counts = profile_counts(events, 2, cuda=True)
    assert counts["host_syncs"] == 3 and counts["kernel_launches"] == 5 and counts["scalar_reads"] == 2
    assert counts["collectives"] == 0.5 and counts["aten_ops"] == 2
    on_cpu = profile_counts(events, 2, cuda=False)
    assert on_cpu["host_syncs"] is None and on_cpu["kernel_launches"] is None


def test_summary_takes_the_slower_process() -> None:
    def rank(r: int, times: list[float]) -> dict:
        return {
            "rank": r, "times_s": times, "mean_s": sum(times) / len(times), "median_s": sorted(times)[1],
            "collectives": 6, "exchanges": 3, "profile": None,
        }  # fmt: skip

    row = summarise("default", [rank(0, [0.1, 0.2, 0.3]), rank(1, [0.2, 0.4, 0.6])], floor_s=0.1)
    assert row["slower_rank"] == 1 and row["mean_s"] == pytest.approx(0.4) and row["median_s"] == 0.4
    assert row["ratio_to_floor"] == pytest.approx(4.0) and row["collectives_per_exchange"] == 2
    assert row["collectives_per_step"] == 2 and row["host_syncs_per_step"] is None


@pytest.mark.slow
@pytest.mark.dist
def test_gpu_bench_runs_every_row_on_cpus(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    cmd = [
        sys.executable, "-m", "benchmarks", "gpu", "--accelerator", "cpu", "--model", "tiny", "--steps", "4",
        "--warmup", "4", "--profile-steps", "4", "--threads", "1", "--timeout", "240", "--json", str(out),
        "--runs", *RUNS, "floor-meet4", "local", "--variants", 'local={"sync_every": 100000, "warmup_steps": 0}',
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert format_table(result) in done.stdout
    assert result["accelerator"] == "cpu" and result["world_size"] == 2 and result["tensors"] == 28
    rows = {r["name"]: r for r in result["runs"]}
    assert list(rows) == [*RUNS, "floor-meet4", "local"]
    assert rows["floor-meet4"]["settings"] == {"meet_every": 4} and rows["floor-meet4"]["collectives"] == 0
    assert rows["local"]["settings"] == {"sync_every": 100000, "warmup_steps": 0}
    assert rows["local"]["exchanges"] == 0 and rows["local"]["collectives"] == 0  # a row that never exchanges
    for name, row in rows.items():
        assert row["status"] == "ok", row
        assert len(row["times_s"]) == 2 and all(len(t) == 4 and min(t) > 0 for t in row["times_s"])
        assert row["mean_s"] == max(row["means_s"]) and row["median_s"] > 0
        assert row["ratio_to_floor"] == pytest.approx(row["mean_s"] / rows["floor"]["mean_s"])
        profile = row["profile"]
        assert profile["aten_ops"] > 0 and profile["scalar_reads"] >= 0
        assert row["host_syncs_per_step"] is None and row["kernel_launches_per_step"] is None  # no CUDA here
        if name in ("local", "floor-meet4"):
            continue
        if RUNS[name].kind == "sparse":
            # update mode: every step exchanges (one fragment of four each step with fragments=4)
            per_step = 1 if name != "every4" else 0.25
            assert row["exchanges"] == 4 * per_step and row["collectives"] > 0
            assert row["collectives_per_exchange"] == row["collectives"] / row["exchanges"]
            assert row["profiled_collectives_per_step"] > 0
        else:
            assert row["collectives"] == 0 and row["collectives_per_exchange"] is None
    assert rows["floor"]["profiled_collectives_per_step"] == 0
    assert rows["dense"]["profiled_collectives_per_step"] >= 1  # DDP's all-reduce of its one bucket
