"""``lightning_sparse.demos`` and the deprecated path it replaces, ``lightning_sparse.tasks``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import lightning_sparse
import lightning_sparse.demos as demos

#: the public names of ``lightning_sparse.tasks`` before the demos moved
OLD_NAMES = [
    "DigitsClassifier",
    "DigitsDataModule",
    "GPTDataModule",
    "NextCharClassifier",
    "TEXT_CHARS",
    "TEXT_TRAIN_FILES",
    "TEXT_VAL_FILES",
    "TEXT_VOCAB",
    "TextDataModule",
    "TinyGPT",
    "accuracy",
    "char_windows",
    "encode_text",
    "load_digits_tensors",
    "load_gpt_tensors",
    "load_text_tensors",
    "stdlib_source",
    "warmup_cosine",
]


def test_demos_export_every_name_of_the_old_module() -> None:
    assert sorted(demos.__all__) == OLD_NAMES
    assert all(hasattr(demos, name) for name in OLD_NAMES)


def test_old_path_warns_and_gives_the_same_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "lightning_sparse.tasks", raising=False)
    monkeypatch.delattr(lightning_sparse, "tasks", raising=False)
    with pytest.warns(
        DeprecationWarning, match=r"lightning_sparse\.tasks is deprecated; use lightning_sparse\.demos"
    ) as w:
        import lightning_sparse.tasks as tasks
    # the warning points at the import, not at the import machinery
    assert [r.filename for r in w if r.category is DeprecationWarning] == [__file__]
    assert sorted(tasks.__all__) == OLD_NAMES
    for name in OLD_NAMES:
        assert getattr(tasks, name) is getattr(demos, name), name
    from lightning_sparse.tasks import DigitsClassifier, TinyGPT

    assert DigitsClassifier is demos.DigitsClassifier and TinyGPT is demos.TinyGPT


def test_nothing_else_imports_the_old_path() -> None:
    """The package, the examples and the tests use the new path (the old one warns on import)."""
    root = Path(__file__).resolve().parent.parent
    allowed = {"lightning_sparse/tasks.py", "tests/test_demos.py"}
    old = re.compile(r"lightning_sparse\.tasks\b|from lightning_sparse import .*\btasks\b")
    found = [
        rel
        for folder in ("lightning_sparse", "examples", "tests")
        for path in sorted((root / folder).rglob("*.py"))
        if (rel := path.relative_to(root).as_posix()) not in allowed and old.search(path.read_text())
    ]
    assert found == []
