"""The benchmarks' tests share the suite's set-up: ``tests/conftest.py`` (this checkout's packages
first on the path, in this process and in every process it starts), its fixtures and helpers, and
``tests/_dist.py``, loaded from there, not copied."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[2] / "tests"


def _suite_conftest() -> ModuleType:
    """``tests/conftest.py`` as a module of its own name (pytest imports it as ``conftest`` when it
    collects ``tests/`` in the same session: executing it twice only repeats its path set-up)."""
    name = "_suite_conftest"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, TESTS / "conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


_suite = _suite_conftest()
dist2 = _suite.dist2  # fixture: two processes in a gloo process group
run_trainer = _suite.run_trainer  # helper: launch a worker script of tests/ and load its results
DistPool = _suite.DistPool  # from tests/_dist.py
