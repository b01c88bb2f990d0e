"""The docstring examples of the benchmarks (CI's ``--doctest-modules`` covers the installed package only)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import benchmarks

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(benchmarks.__path__, "benchmarks.")
    if not m.name.startswith("benchmarks.tests") and not m.name.endswith("__main__")
)


def test_found_the_modules() -> None:
    assert {"benchmarks.peers", "benchmarks.scale.model", "benchmarks.convergence.runs"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    if name in ("benchmarks.convergence.hf_gpt", "benchmarks.convergence.hf_resnet"):
        pytest.importorskip("transformers")  # the bench extra's; not a dependency of the library
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} docstring examples failed"
