"""A stalled exchange says where it was: when a rank stops (SIGSTOP) or fails inside the exchange,
the other rank's error names the bucket, the way it was sent, the optimizer step, the collective
and the rank, and says what to check (2 real processes, a 15-second process-group timeout)."""

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

import pytest
import torch

pytestmark = pytest.mark.dist

HERE = Path(__file__).parent
TIMEOUT_S = 15
STALL_STEP = 5


def _launch(config: dict[str, Any], out_dir: Path, limit: float = 120) -> str:
    """Run tests/trainer_worker.py in its own session; after the launcher ends (or ``limit``), kill
    whatever is left of the session (a stopped rank) and return everything the ranks printed."""
    from lightning_sparse._utils import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "config.json"
    cfg_path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    env["MASTER_PORT"] = str(free_port())
    log = out_dir / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "trainer_worker.py"), str(cfg_path)],
            cwd=out_dir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=limit)
            # a rank that outlives the launcher reports its own timeout: wait for its message
            deadline = time.monotonic() + 2 * TIMEOUT_S
            while time.monotonic() < deadline and "Another rank did not take part" not in log.read_text(
                errors="replace"
            ):
                time.sleep(0.5)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return log.read_text(errors="replace")


CASES = {
    # (mode, exchange or path, how the other rank fails)
    "update_allgather_stop": ("update", {"exchange": "allgather"}, "stop", "all-gather"),
    "update_split_raise": ("update", {"exchange": "split"}, "raise", "all-to-all"),
    "update_dense_stop": ("update", {"min_numel": 10**9}, "stop", "all-reduce"),
    "gradient_allgather_raise": ("gradient", {"exchange": "allgather"}, "raise", "all-gather"),
    "gradient_split_stop": ("gradient", {"exchange": "split"}, "stop", "all-to-all"),
    "gradient_dense_stop": ("gradient", {"min_numel": 10**9}, "stop", "all-reduce"),
}


# two cases in the default run (a stopped rank, a failing one; ~30 s each); the rest with -m slow
FAST = ("update_allgather_stop", "gradient_allgather_raise")


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_a_stalled_exchange_says_where_it_was(tmp_path: Path, case: str) -> None:
    mode, extra, how, collective = CASES[case]
    # "raise": rank 0 fails inside its exchange, rank 1 waits; "stop": rank 1 stops, rank 0 waits
    stalled = 0 if how == "raise" else 1
    config = {
        "n": 256,
        "max_steps": 12,
        "data_by_step": True,
        "strategy": {
            "compressor": "topk", "density": 0.05, "fallback_to_dense": False, "compress": mode,
            "timeout_s": TIMEOUT_S, **extra,
        },
        "stall_at_step": STALL_STEP,
        "stall_rank": stalled,
        "stall": how,
    }  # fmt: skip
    started = time.perf_counter()
    text = _launch(config, tmp_path)
    waiting = 1 - stalled
    pattern = (
        rf"lightning_sparse: rank {waiting} of 2 \({mode} mode\): the exchange of .+ at optimizer step "
        rf"{STALL_STEP} failed in its {collective} of [\d,]+ bytes: .+\. Another rank did not take part in time"
    )
    assert re.search(pattern, text), text[-6000:]
    assert "SparseDDPStrategy(timeout=datetime.timedelta(...))" in text
    assert time.perf_counter() - started < 150, "the waiting rank ends within seconds of the timeout"


@pytest.mark.parametrize("mode", ["update", pytest.param("gradient", marks=pytest.mark.slow)])
def test_a_killed_rank_ends_the_others_and_the_fit_resumes(tmp_path: Path, mode: str) -> None:
    """Rank 1 dies (SIGKILL) at step 10 of a fit that writes last.ckpt every 4 steps: rank 0 ends
    within seconds, not after the process group's timeout (60 s here), and the fit resumed from
    last.ckpt equals the uninterrupted fit to the bit, with identical replicas."""
    strategy = {"compressor": "topk", "density": 0.05, "compress": mode, "timeout_s": 60}
    base = {"n": 256, "max_steps": 16, "data_by_step": True, "strategy": strategy}
    killed = tmp_path / "killed"
    text = _launch({**base, "checkpoint_every": 4, "stall_at_step": 10, "stall_rank": 1, "stall": "kill"}, killed)
    ended = time.time()
    match = re.search(r"rank 1 killed at ([\d.]+)", text)
    assert match, text[-6000:]
    assert ended - float(match.group(1)) < 30, f"rank 0 took {ended - float(match.group(1)):.0f} s to end"
    assert "lightning_sparse: rank 0 of 2" in text and "Another rank did not take part" in text, text[-6000:]
    last = killed / "ckpts" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 8

    from conftest import run_trainer

    runs = run_trainer(
        {**base, "runs": [{"name": "resumed", "ckpt_path": str(last)}, {"name": "uninterrupted"}]},
        tmp_path / "resumed",
    )
    resumed, uninterrupted = runs["resumed"], runs["uninterrupted"]
    for rank in (0, 1):
        assert resumed[rank]["global_step"] == 16
        for key, value in uninterrupted[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][key], value), f"rank {rank}: {key} differs"
            assert torch.equal(resumed[1 - rank]["params"][key], value), "the replicas differ"
        for key, value in uninterrupted[rank]["residuals"].items():
            assert torch.equal(resumed[rank]["residuals"][key], value), f"rank {rank}: residual {key} differs"


@pytest.mark.slow
def test_a_delayed_exchange_that_stalls_names_the_step_that_launched_it(tmp_path: Path) -> None:
    """sync_every=4, sync_delay=2: exchanges launch at the 4th and 8th optimizer steps (0-based 3 and
    7, as errors count them) and are waited for two steps later. Rank 1 stops before its 6th step;
    rank 0 goes on past the launch at the 8th (it does not wait there) and times out waiting at the
    10th. Its error names optimizer step 7, where the exchange was launched (exchange 1)."""
    strategy = {
        "compressor": "topk", "density": 0.05, "fallback_to_dense": False, "sync_every": 4, "sync_delay": 2,
        "warmup_steps": 0, "timeout_s": TIMEOUT_S,
    }  # fmt: skip
    config = {"n": 256, "max_steps": 16, "data_by_step": True, "strategy": strategy}
    text = _launch({**config, "stall_at_step": 5, "stall_rank": 1, "stall": "stop"}, tmp_path)
    pattern = (
        r"lightning_sparse: rank 0 of 2 \(update mode\): the exchange of .+ at optimizer step (\d+) \(exchange 1\) "
        r"failed in its "
        r"all-gather of [\d,]+ bytes: .+\. Another rank did not take part in time"
    )
    match = re.search(pattern, text)
    assert match, text[-6000:]
    assert match.group(1) == "7", match.group(0)
