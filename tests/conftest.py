from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent
# Test the package of this checkout, in this process and in every process it starts.
sys.path[:0] = [str(ROOT), str(HERE)]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

from _dist import DistPool  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the process pool starts processes: it is a ``dist`` test, marked or not."""
    for item in items:
        if "dist2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.dist)


@pytest.fixture(scope="session")
def dist2():
    """Two processes in a gloo process group; ``dist2.run(fn, **kwargs)`` returns per-rank results."""
    pool = DistPool(world_size=2)
    yield pool
    pool.stop()


def run_trainer(config: dict[str, Any], out_dir: Path, timeout: float = 240, worker: str = "trainer_worker.py") -> Any:
    """Launch tests/trainer_worker.py, or another ``worker`` script of tests/ that writes its results
    the same way (Lightning's popen launcher starts the other ranks).

    Returns the per-rank results the worker saved, or, for a config with ``runs``, a dict of them
    by run name. The launcher's output is kept in ``out_dir/log.txt``. A hung rank fails the test
    via ``timeout``.
    """
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "config.json"
    cfg_path.write_text(json.dumps(config))
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    from lightning_sparse._utils import free_port

    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run(
        [sys.executable, str(HERE / worker), str(cfg_path)],
        cwd=out_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    (out_dir / "log.txt").write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"{worker} failed with exit code {proc.returncode}\n--- stdout ---\n{proc.stdout[-5000:]}"
            f"\n--- stderr ---\n{proc.stderr[-8000:]}"
        )

    def load(prefix: str, world: int) -> list[dict[str, Any]]:
        return [torch.load(out_dir / f"{prefix}rank{r}.pt", weights_only=False) for r in range(world)]

    if "runs" in config:
        return {
            run["name"]: load(f"{run['name']}_", run.get("devices", config.get("devices", 2))) for run in config["runs"]
        }
    return load("", config.get("devices", 2))
