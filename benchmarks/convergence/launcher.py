"""Starting one run of the convergence benchmark as its own subprocess, under a timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._ranks import checkout_env, free_port
from benchmarks.convergence.runs import _kind, _mode


def _run_name(config: dict[str, Any]) -> str:
    kind = _kind(config)
    if kind == "peer":
        tail = config["peer"]
    elif kind == "dense":
        tail = "dense_1"
    else:
        tail = f"{config['compressor']}_{config['density']:g}_{_mode(config)}"
        for key in ("exchange", "value_dtype"):
            if config.get(key) not in (None, "auto"):
                tail += f"_{config[key]}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{config['task']}_{tail}")


def launch(config: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    """Run one fit in a fresh process group; returns its figures, or ``status`` "failed"/"timeout"."""
    name = _run_name(config)
    cfg_path, log_path = workdir / f"{name}.json", workdir / f"{name}.log"
    config = {**config, "result": str(workdir / f"{name}.result.json")}
    cfg_path.write_text(json.dumps(config))
    env = dict(os.environ)
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK"):
        env.pop(key, None)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
    )
    env = checkout_env(env)  # the worker, and the ranks Lightning starts from it, import this package
    cmd = [sys.executable, "-m", "benchmarks.convergence", "--worker", str(cfg_path)]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # own session: on a timeout the whole group (rank 0 and the ranks it launched) is killed
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    wall = time.perf_counter() - start
    try:  # a rank that outlived rank 0 (a crash on one rank) would keep a core busy
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    result_path = Path(config["result"])
    if rc == 0 and result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace")[-3000:]
        status = "timeout" if rc is None else f"failed (exit code {rc})"
        print(f"  {name}: {status}; end of its output:\n{tail}", file=sys.stderr)
        result = {"status": status, "final_acc": None, "final_loss": None, "sent_bytes": 0, "points": []}
    result["process_seconds"] = wall
    return result
