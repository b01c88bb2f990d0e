"""The benchmarks are not installed: pyproject.toml's package find configuration takes the library only."""

from __future__ import annotations

from pathlib import Path

import setuptools
from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[2]


def _installed_packages() -> list[str]:
    """The packages ``pip install`` ships: setuptools' find, with pyproject.toml's settings read as
    setuptools reads them."""
    find = read_configuration(ROOT / "pyproject.toml", expand=False)["tool"]["setuptools"]["packages"]["find"]
    where = find.get("where", ["."])
    assert len(where) == 1, where
    return setuptools.find_packages(
        where=str(ROOT / where[0]), include=find.get("include", ("*",)), exclude=find.get("exclude", ())
    )


def test_the_benchmarks_are_not_installed() -> None:
    packages = _installed_packages()
    assert "lightning_sparse" in packages and "lightning_sparse.wire" in packages
    assert "benchmarks" in setuptools.find_packages(where=str(ROOT))  # a package: only the config keeps it out
    assert [p for p in packages if p.split(".")[0] != "lightning_sparse"] == [], packages
