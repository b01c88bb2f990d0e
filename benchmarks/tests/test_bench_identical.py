"""``python -m benchmarks identical``: the same code run twice (a copy of the tree's package against
the tree) gives equal checksums with the replicas checked, and different settings give different
ones; the package at a revision comes out of git as it is there."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks._ranks import CHECKOUT
from benchmarks._revs import extract
from benchmarks.identical import SETTINGS, compare


def test_extract_writes_the_package_as_git_has_it(tmp_path: Path) -> None:
    commit = extract("HEAD", tmp_path)
    shown = subprocess.run(
        ["git", "-C", str(CHECKOUT), "show", f"{commit}:lightning_sparse/__init__.py"],
        capture_output=True,
        check=True,
    ).stdout
    assert (tmp_path / "lightning_sparse" / "__init__.py").read_bytes() == shown
    with pytest.raises(ValueError, match="--rev='no-such-revision' is not allowed"):
        extract("no-such-revision", tmp_path / "other")


@pytest.mark.slow
@pytest.mark.dist
def test_the_same_code_twice_gives_equal_checksums(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(CHECKOUT / "lightning_sparse", copy / "lightning_sparse")
    settings = [SETTINGS["default"], SETTINGS["gradient"]]
    rows = compare(copy, settings, steps=4, work=tmp_path / "runs", timeout=300, progress=False)
    for row in rows:
        assert row["equal"], row
        assert row["old_problems"] == row["new_problems"] == [], row
        assert len(row["old"]) == 64
    # the package each side imported is the one asked for (the worker refuses any other)
    config = (tmp_path / "runs" / "old2" / "config.json").read_text()
    assert str(copy) in config
    assert rows[0]["old"] != rows[1]["old"]  # another setting, other parameters
