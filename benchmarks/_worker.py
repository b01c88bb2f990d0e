"""What the worker scripts share (``identical_worker.py``, ``calls_worker.py``). They run as scripts,
with this folder first on ``sys.path``, and import it as ``_worker``: no ``benchmarks`` module is
importable there, only the package under test."""

from __future__ import annotations

import os
from pathlib import Path


def start(root: str) -> None:
    """Check that the imported ``lightning_sparse`` lies under ``root`` (the folder on
    ``PYTHONPATH`` decided it, not an installed copy: ``RuntimeError`` otherwise), and make this
    process deterministic: one thread, deterministic algorithms.

    Example:
        >>> start("/nowhere")
        Traceback (most recent call last):
        ...
        RuntimeError: imported lightning_sparse from ..., expected it under /nowhere
    """
    import torch

    import lightning_sparse

    imported = Path(lightning_sparse.__file__).resolve()
    if Path(root).resolve() not in imported.parents:
        raise RuntimeError(f"imported lightning_sparse from {imported}, expected it under {root}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
