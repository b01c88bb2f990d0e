"""``python -m benchmarks compressors`` on tiny sizes: the code path and its output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import main
from benchmarks.compressors import BASELINE, DEFAULT_COMPRESSORS, TORCH_TOPK, parse_compressor
from lightning_sparse.compressors import COMPRESSORS, CountSketch


def test_compressors_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["compressors", "--numel", "3000", "20000", "--density", "0.01", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    names = [BASELINE, TORCH_TOPK, *DEFAULT_COMPRESSORS]
    assert set(COMPRESSORS) <= set(names)  # every registered compressor has a row by default
    assert [(r["numel"], r["name"]) for r in rows] == [(n, name) for n in (3000, 20000) for name in names]
    for r in rows:
        assert r["k"] == round(0.01 * r["numel"]) and r["median_s"] > 0 and r["ratio"] > 0
        assert r["name"] in printed
    assert all(r["ratio"] == 1.0 for r in rows if r["name"] == BASELINE)
    assert "x memory pass" in printed and "20,000" in printed


def test_compressor_specs() -> None:
    assert parse_compressor("countsketch:p1=0,rows=3") == CountSketch(rows=3, p1=0)
    assert parse_compressor("CountSketch:p1=auto") == CountSketch()
    with pytest.raises(ValueError, match="compressor 'nope' is not allowed"):
        parse_compressor("nope")
    with pytest.raises(ValueError, match="rows=4 is not allowed"):
        parse_compressor("countsketch:rows=4")
    with pytest.raises(ValueError, match="expected name=value"):
        parse_compressor("countsketch:rows")
    with pytest.raises(ValueError, match="--repeats=0 is not allowed"):
        main(["compressors", "--numel", "100", "--repeats", "0"])


def test_feedback_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from benchmarks.compressors import feedback_tensor

    # the residual keeps everything but the k largest each step: the sum of the gradients minus what was sent
    gen = torch.Generator().manual_seed(0)
    x = feedback_tensor(2000, 20, 5, gen, torch.device("cpu"))
    ref_gen = torch.Generator().manual_seed(0)
    e = torch.zeros(2000)
    for _ in range(5):
        e += torch.randn(2000, generator=ref_gen)
        e[e.abs().topk(20).indices] = 0.0
    assert torch.equal(x, e + torch.randn(2000, generator=ref_gen))
    assert feedback_tensor(10, 1, 0, torch.Generator().manual_seed(1), torch.device("cpu")).shape == (10,)
    out = tmp_path / "bench.json"
    argv = ["compressors", "--numel", "5000", "--density", "0.01", "--repeats", "1", "--feedback-steps", "3"]
    assert main([*argv, "--compressors", "topk", "gaussiank", "--json", str(out)]) == 0
    assert "after 3 steps of top-k error feedback" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["feedback_steps"] == 3 and all(r["feedback_steps"] == 3 for r in payload["rows"])
    with pytest.raises(ValueError, match="--feedback-steps=-1 is not allowed"):
        main(["compressors", "--numel", "100", "--feedback-steps", "-1"])
