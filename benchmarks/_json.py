"""The benchmarks' JSON files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, payload: Any) -> None:
    """Write ``payload`` to ``path`` as JSON, indented by two spaces (the file is replaced)."""
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
