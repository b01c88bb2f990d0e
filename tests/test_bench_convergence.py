"""``python -m lightning_sparse.bench convergence`` on tiny sizes, and the text task it trains."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_sparse.bench.__main__ import main
from lightning_sparse.bench.convergence import DENSE, plot, table, target_check
from lightning_sparse.tasks import (
    TEXT_VOCAB,
    NextCharClassifier,
    TextDataModule,
    encode_text,
    load_text_tensors,
    stdlib_source,
)


def test_text_data_deterministic_and_shapes() -> None:
    train, val = load_text_tensors(context=16, n_train=3000, n_val=500, seed=0)
    again_train, again_val = load_text_tensors(context=16, n_train=3000, n_val=500, seed=0)
    other_train, _ = load_text_tensors(context=16, n_train=3000, n_val=500, seed=1)
    for a, b in zip(train.tensors + val.tensors, again_train.tensors + again_val.tensors, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(train.tensors[0], other_train.tensors[0])  # the seed draws the positions
    assert train.tensors[0].shape == (3000, 16) and train.tensors[1].shape == (3000,)
    assert val.tensors[0].shape == (500, 16) and val.tensors[1].shape == (500,)
    for t in train.tensors + val.tensors:
        assert t.dtype == torch.long and 0 <= int(t.min()) and int(t.max()) < TEXT_VOCAB
    # a window followed by its target is a piece of the source
    codes = encode_text(stdlib_source(["calendar.py", "functools.py", "csv.py"]))
    x, y = val.tensors[0][7], val.tensors[1][7]
    window = torch.cat([x, y[None]])
    assert any(torch.equal(codes[i : i + 17], window) for i in range(len(codes) - 16))
    # not just spaces: the targets are varied text
    assert len(set(train.tensors[1].tolist())) > 40
    with pytest.raises(ValueError, match="n_train=0"):
        load_text_tensors(n_train=0)
    with pytest.raises(FileNotFoundError):
        stdlib_source(["no_such_module_here.py"])


def test_text_module_shapes_and_sparse_tensors() -> None:
    dm = TextDataModule(batch_size=8, n_train=64, n_val=16)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 16) and y.shape == (8,)
    model = NextCharClassifier()
    logits = model(x)
    assert logits.shape == (8, TEXT_VOCAB)
    torch.nn.functional.cross_entropy(logits, y).backward()
    # every weight tensor goes sparse with the strategy's default min_numel=1024; biases dense
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape
        assert (p.numel() > 1024) == ("weight" in name), name


def test_convergence_tiny_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    argv = ["convergence", "--tasks", "digits", "text", "--compressors", "topk", "--densities", "0.01"]
    argv += ["--epochs", "2", "--limit-train-batches", "4", "--timeout", "240", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    md = (out / "convergence.md").read_text()
    for task in ("digits", "text"):
        assert f"### {task}" in md and f"### {task}" in printed
    assert md.count("| dense DDP | 1 |") == 2 and md.count("| topk | 0.01 |") == 2
    payload = json.loads((out / "convergence.json").read_text())
    assert set(payload["runs"]) == {"digits", "text"}
    for task, runs in payload["runs"].items():
        assert [(r["compressor"], r["density"]) for r in runs] == [(None, 1.0), ("topk", 0.01)], task
        dense, sparse = runs
        for r in runs:
            assert r["status"] == "ok", (task, r)
            assert r["steps"] == 8
            assert 0.0 <= r["final_acc"] <= 1.0
            assert [p["step"] for p in r["points"]] == [4, 8]  # one validation per epoch
            assert all(0.0 <= p["acc"] <= 1.0 for p in r["points"])
            assert r["points"][-1]["sent_bytes"] == r["sent_bytes"] > r["points"][0]["sent_bytes"] > 0
        # dense DDP all-reduces every gradient each step; the telemetry counts that same figure as dense bytes
        assert dense["sent_bytes"] == dense["dense_bytes"] == 8 * dense["param_bytes"]
        assert sparse["dense_bytes"] == dense["sent_bytes"]
        assert 0 < sparse["sent_bytes"] < dense["sent_bytes"]
        assert sparse["sent_as"]["topk"] > 0 and sparse["sent_as"]["dense (warm-up)"] == dense["param_bytes"]
    # the saved runs re-render to the same table without training again
    again = tmp_path / "again"
    assert main(["convergence", "--from-json", str(out / "convergence.json"), "--out", str(again)]) == 0
    assert (again / "convergence.md").read_text() == md
    assert json.loads((again / "convergence.json").read_text()) == payload
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert 'pip install "lightning_sparse[plot]"' in printed
    else:
        for task in ("digits", "text"):
            assert (out / f"convergence_{task}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_convergence_timeout_is_reported(tmp_path: Path) -> None:
    argv = ["convergence", "--tasks", "digits", "--compressors", "topk", "--densities", "0.01", "--no-dense"]
    argv += ["--epochs", "1", "--timeout", "0.5", "--out", str(tmp_path)]
    assert main(argv) == 0
    runs = json.loads((tmp_path / "convergence.json").read_text())["runs"]["digits"]
    assert [r["status"] for r in runs] == ["timeout"]
    assert "| topk | 0.01 | timeout |" in (tmp_path / "convergence.md").read_text()


def _run(compressor: str | None, density: float, acc: float, sent: int) -> dict:
    points = [{"epoch": 0, "step": 10, "acc": acc - 0.1, "sent_bytes": sent // 2, "dense_bytes": 500}]
    points.append({"epoch": 1, "step": 20, "acc": acc, "sent_bytes": sent, "dense_bytes": 1000})
    return {
        "compressor": compressor,
        "density": density,
        "status": "ok",
        "final_acc": acc,
        "sent_bytes": sent,
        "dense_bytes": 1000,
        "fit_seconds": 1.0,
        "points": points,
    }


def test_table_target_and_missing_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [
        _run(None, 1.0, 0.90, 1000),
        _run("topk", 0.01, 0.895, 25),
        _run("randomk", 0.01, 0.50, 20),
        _run("dgc", 0.01, 0.91, 40),
        _run("topk", 0.1, 0.90, 200),
    ]
    lines = table("t", runs)
    assert lines[2].startswith(f"| {DENSE} | 1 | 0.9000 | +0.00 | 1.00 kB | 1.0x |")
    assert lines[3].startswith("| topk | 0.01 | 0.8950 | -0.50 | 25 B | 40.0x |")
    check = target_check(runs)
    assert check["topk"]["met"] and check["best_other"]["compressor"] == "dgc"
    assert not check["best_other"]["met"] and not check["met"]  # dgc: 25x < 30x
    # an equally accurate compressor that meets the target (fewer bytes) is the best other one
    check = target_check([*runs, _run("gaussiank", 0.01, 0.91, 30), _run("countsketch", 0.01, 0.95, 500)])
    assert check["best_other"]["compressor"] == "gaussiank" and check["met"]
    assert abs(check["best_other"]["reduction"] - 1000 / 30) < 1e-9
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert plot("t", runs, tmp_path / "t.png") is False
    assert not (tmp_path / "t.png").exists()
