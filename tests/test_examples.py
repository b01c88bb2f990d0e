"""The example scripts the documentation tells people to run, run briefly (2 CPU processes each).

The documentation's commands run these scripts with their full settings (30 epochs, 3 seeds,
several machines); here the same scripts and launchers run for an epoch or a few steps, so a
command in the docs cannot silently break. See tests/test_docs.py for the list of commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_sparse._utils import free_port

pytestmark = pytest.mark.dist

pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def test_train_digits_runs(tmp_path: Path) -> None:
    """`python examples/train_digits.py`, one epoch: dense DDP, then sparse_ddp, and the comparison."""
    out = _run([sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "1"], tmp_path)
    assert "dense DDP" in out and "sparse_ddp topk 0.01" in out and "compression ratio" in out


def test_fabric_digits_runs(tmp_path: Path) -> None:
    """`python examples/fabric_digits.py`, one epoch: Fabric(strategy="sparse_ddp") on 2 processes."""
    out = _run([sys.executable, str(ROOT / "examples" / "fabric_digits.py"), "--epochs", "1"], tmp_path)
    assert "compression ratio" in out


def test_compare_schedules_runs(tmp_path: Path) -> None:
    """`python examples/compare_schedules.py`, one adaptive run of one epoch, with the docs' options."""
    cmd = [sys.executable, str(ROOT / "examples" / "compare_schedules.py"), "--epochs", "1", "--seeds", "0"]
    cmd += ["--c0", "3000", "--min-density", "0.0001", "--only", "adaptive", "--no-error-feedback"]
    out = _run(cmd, tmp_path)
    assert "adaptive (bits, c0 = 3000)" in out and "without error feedback" in out


def test_multinode_under_torchrun(tmp_path: Path) -> None:
    """`torchrun ... examples/multinode.py` on one machine: torchrun starts the 2 processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(ROOT / "examples" / "multinode.py"), "--devices", "2"]
    out = _run(cmd + ["--max-steps", "3"], tmp_path)
    assert "world size 2 (TorchElasticEnvironment)" in out


def test_multinode_under_slurm_variables(tmp_path: Path) -> None:
    """`srun python examples/multinode.py`, emulated on one machine: 2 processes started with the
    variables srun sets, so Lightning's SLURMEnvironment gives the ranks (no real SLURM here)."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = _env()
        env.update(
            {
                "SLURM_NTASKS": "2",
                "SLURM_NTASKS_PER_NODE": "2",
                "SLURM_NNODES": "1",
                "SLURM_JOB_NUM_NODES": "1",
                "SLURM_JOB_NAME": "digits",
                "SLURM_JOB_ID": "1",
                "SLURM_JOB_NODELIST": "127.0.0.1",
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_NODEID": "0",
                "MASTER_PORT": port,
            }
        )
        cmd = [sys.executable, str(ROOT / "examples" / "multinode.py"), "--devices", "2", "--max-steps", "3"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=300)
            outs.append(out.decode())
            assert proc.returncode == 0, outs[-1][-6000:]
    finally:
        for proc in procs:
            proc.kill()
    assert "world size 2 (SLURMEnvironment)" in outs[0]


def _stop(proc: subprocess.Popen) -> None:
    """Stop a torchrun launcher: SIGTERM (it stops its workers first), then SIGKILL 30 s later."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _run_together(cmds: list[list[str]], cwd: Path, env: dict[str, str], logs: list[Path], timeout: float) -> list:
    """Run ``cmds`` at once, each one's output in ``{log}.stdout`` and ``{log}.stderr``; return their
    exit codes, None for one that was stopped: all of them after ``timeout`` s, the others 30 s after
    one fails (a torchrun agent waits up to 300 s at exit for the other nodes' agents, failed or not)."""
    with contextlib.ExitStack() as files:
        procs = []
        for cmd, log in zip(cmds, logs, strict=True):
            out = files.enter_context(open(f"{log}.stdout", "w"))
            err = files.enter_context(open(f"{log}.stderr", "w"))
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err))
        start, failed_at = time.monotonic(), None
        try:
            while None in (codes := [proc.poll() for proc in procs]):
                now = time.monotonic()
                if failed_at is None and any(code not in (None, 0) for code in codes):
                    failed_at = now
                if now - start > timeout or (failed_at is not None and now - failed_at > 30):
                    break
                time.sleep(0.5)
        finally:
            codes = [proc.poll() for proc in procs]
            for proc in procs:
                if proc.poll() is None:
                    _stop(proc)
    return codes


@pytest.mark.parametrize("compress", ["update", pytest.param("gradient", marks=pytest.mark.slow)])
def test_multinode_two_nodes_under_torchrun(tmp_path: Path, compress: str) -> None:
    """`torchrun --nnodes 2 ... examples/multinode.py --num-nodes 2`, both "nodes" on this machine:
    two torchrun launchers of 2 processes each (node ranks 0 and 1) meet over loopback, and the 4
    replicas end with identical parameters. Then the checkpoint of those 4 processes resumes on one
    node of 2 (the resize rule): the replicas end identical again and training went on."""
    port, digests = str(free_port()), tmp_path / "digests"
    env = _env()
    env["GLOO_SOCKET_IFNAME"] = "lo"
    cmds = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
        cmd += ["--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", port]
        cmd += [str(ROOT / "examples" / "multinode.py"), "--num-nodes", "2", "--devices", "2", "--max-steps", "6"]
        cmd += ["--save-checkpoint", str(tmp_path / "four.ckpt")]
        cmds.append(cmd + ["--compress", compress, "--digest-dir", str(digests)])
    logs = [tmp_path / "node0", tmp_path / "node1"]
    codes = _run_together(cmds, tmp_path, env, logs, timeout=240)
    records = [json.loads(path.read_text()) for path in sorted(digests.glob("rank*.json"))]

    def report() -> str:
        parts = [f"exit codes {codes} (None: stopped), digest files: {records}"]
        for node_rank, log in enumerate(logs):
            for stream, tail in (("stdout", 3000), ("stderr", 6000)):
                path = Path(f"{log}.{stream}")
                text = path.read_text(errors="replace")[-tail:] if path.exists() else "(none)"
                parts.append(f"--- node {node_rank} {stream} ---\n{text}")
        return "\n".join(parts)

    assert codes == [0, 0], report()
    assert len(records) == 4, report()
    assert {r["world_size"] for r in records} == {4}, report()
    assert sorted(r["global_rank"] for r in records) == [0, 1, 2, 3], report()
    assert sorted((r["node_rank"], r["local_rank"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)], report()
    assert len({r["sha256"] for r in records}) == 1, f"the replicas differ: {records}"
    assert f"world size 4 (TorchElasticEnvironment), compress {compress}" in Path(f"{logs[0]}.stdout").read_text()

    # 2 nodes x 2 -> 1 node x 2
    resumed = tmp_path / "resumed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(ROOT / "examples" / "multinode.py"), "--devices", "2"]
    cmd += ["--compress", compress, "--max-steps", "12", "--ckpt-path", str(tmp_path / "four.ckpt")]
    out = _run(cmd + ["--digest-dir", str(resumed)], tmp_path, env={**_env(), "PYTHONWARNINGS": "default"})
    records = [json.loads(path.read_text()) for path in sorted(resumed.glob("rank*.json"))]
    assert [r["world_size"] for r in records] == [2, 2]
    assert len({r["sha256"] for r in records}) == 1, f"the replicas differ after the resize: {records}"
    assert "written by 4 processes and is resumed on 2" in out
    assert f"world size 2 (TorchElasticEnvironment), compress {compress}: step 12" in out
