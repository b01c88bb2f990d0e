"""``python -m benchmarks calls``: the profile counts the calls under the span, apart from the
optimizer's own, and the moves between a package's files; on 2 processes one default exchange of
the 148-tensor GPT makes calls through files of the package, about the same number every measured
step."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from benchmarks._ranks import CHECKOUT
from benchmarks.calls import measure
from benchmarks.calls_worker import CallProfile


def test_the_profile_counts_the_span_the_files_and_the_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from pkg import b\n\ndef root():\n    return b.f() + b.f() + step() + len('x')\n\n"
        "def step():\n    return sum([b.g()])\n"
    )
    (package / "b.py").write_text("def f():\n    return g()\n\ndef g():\n    return abs(-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a = importlib.import_module("pkg.a")
    profile = CallProfile(a.root.__code__, a.step.__code__, str(package))
    sys.setprofile(profile)
    try:
        a.root()
    finally:
        sys.setprofile(None)
    a.root()  # outside the profile: nothing more counted
    assert profile.done
    # root, f, g, f, g; abs, abs, len
    assert (profile.outside["call"], profile.outside["c_call"]) == (5, 3)
    # under step: step, g; sum, abs
    assert (profile.inside["call"], profile.inside["c_call"]) == (2, 2)
    assert profile.files == {"a.py": 1, "b.py": 4}
    assert profile.entries == {"a.py": 1, "b.py": 2}  # root from outside; f from a.py twice (g from f: no move)
    assert profile.moves == 2


@pytest.mark.dist
def test_one_default_exchange_counts_calls_through_the_package(tmp_path: Path) -> None:
    figures = measure(CHECKOUT, tmp_path / "tree", warmup=2, measured=2, timeout=300)
    assert figures["complete"] and figures["tensors"] == 148
    assert figures["exchange"]["call"] > figures["package"]["call"] > 0
    assert figures["exchange"]["c_call"] > 0 and figures["optimizer"]["call"] > 0
    assert figures["files"] and all((CHECKOUT / "lightning_sparse" / f).is_file() for f in figures["files"])
    assert sum(figures["files"].values()) == figures["package"]["call"]
    assert 0 < figures["moves"] < figures["package"]["call"]
    # a steady state: every measured step alike, but for the few callbacks a collective already done
    # runs on this thread (more of them on a loaded machine)
    calls = [c["call"] for counts in figures["per_step"].values() for c in counts]
    assert len(calls) == 4 and max(calls) - min(calls) <= 0.05 * min(calls), calls
    assert figures["exchange"]["call"] == min(calls)
