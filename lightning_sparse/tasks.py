"""Deprecated: the example models moved to ``lightning_sparse.demos``; this path re-exports every
public name of it for one more release."""

from __future__ import annotations

import warnings

import lightning_sparse.demos as _demos
from lightning_sparse.demos import *  # noqa: F403 - the old path gives the same objects as the new one

__all__ = _demos.__all__

warnings.warn(
    "lightning_sparse.tasks is deprecated; use lightning_sparse.demos; "
    "the old path will be removed in a future release",
    DeprecationWarning,
    stacklevel=2,
)
