"""Exit code 0 every time: many short multi-process runs, the exit status of every process checked.

A rank used to abort at interpreter exit once in a while after its training had finished
(``terminate called without an active exception``, exit code -6): a gloo worker thread freeing the
last collective's tensors took the interpreter lock after Python's shutdown had begun (see
``docs/guarantees.md``, "Exit code"). The strategies end the process group at exit on every rank
together (``lightning_sparse._utils.end_process_group_at_exit``). Here the examples (Trainer,
Lightning CLI, Fabric) and plain user scripts that call nothing at their end run many times, on 2
and 4 processes, in both modes; a last test forces the race: the last collective completes while
rank 0 is leaving, with the interpreter lock held by an exit handler.

Lightning's launcher starts ranks 1.. as children of rank 0 and does not report their exit codes,
so every Python process of a run starts through ``sitecustomize`` (written here, found through
``PYTHONPATH``): it forks at interpreter start, runs the script in the child and records the
child's exit status (negative: the signal) in a JSON file before leaving with it. Marked slow
(about 45 minutes on 2 CPU cores): ``pytest -m slow tests/test_exit_stress.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("jsonargparse")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
pytestmark = [pytest.mark.slow, pytest.mark.dist]

MODES = ("update", "gradient")
# (processes, repeats): the examples 200 process exits in all, the users' case (2 processes) most often
EXAMPLE_SIZES = ((2, 10), (4, 5))
USER_SIZES = ((2, 3), (4, 1))

SITECUSTOMIZE = """
import os

_LOG = os.environ.get("EXIT_STRESS_LOG")
if _LOG and os.environ.get("EXIT_STRESS_CHILD") != str(os.getppid()):
    import ctypes
    import json
    import signal
    import sys

    _pid = os.fork()
    if _pid == 0:
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed with its recorder
        except Exception:
            pass
        os.environ["EXIT_STRESS_CHILD"] = str(os.getppid())
    else:
        _, _status = os.waitpid(_pid, 0)
        _code = os.waitstatus_to_exitcode(_status)
        with open(os.path.join(_LOG, f"{_pid}.json"), "w") as _f:
            json.dump({"pid": _pid, "code": _code, "argv": sys.argv, "local_rank": os.environ.get("LOCAL_RANK")}, _f)
        if _code < 0:
            signal.signal(-_code, signal.SIG_DFL)
            os.kill(os.getpid(), -_code)
        os._exit(_code)
"""

# A user's Trainer script that calls nothing at its end: fit, then validate and test with the same Trainer.
USER_TRAINER = """
import sys

import lightning as L
import torch

import lightning_sparse
from lightning_sparse.demos import DigitsClassifier, DigitsDataModule

devices, compress = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
L.seed_everything(0, verbose=False)


class Classifier(DigitsClassifier):
    test_step = DigitsClassifier.validation_step


model = Classifier(lr=0.05, momentum=0.9)
data = DigitsDataModule(batch_size=32)
trainer = L.Trainer(
    accelerator="cpu", devices=devices, strategy=lightning_sparse.SparseDDPStrategy(compress=compress),
    max_steps=4, limit_val_batches=2, limit_test_batches=2, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
)
trainer.fit(model, datamodule=data)
trainer.validate(model, datamodule=data, verbose=False)
trainer.test(model, dataloaders=data.val_dataloader(), verbose=False)
"""

# A user's Fabric loop that calls nothing at its end.
USER_FABRIC = """
import sys

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

import lightning_sparse
from lightning_sparse.demos import load_digits_tensors

devices, compress = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
strategy = lightning_sparse.FabricSparseDDPStrategy(compress=compress)
fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
fabric.launch()
fabric.seed_everything(0, verbose=False)
train_set, _ = load_digits_tensors(seed=0)
loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=32, shuffle=True, drop_last=True))
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if compress == "gradient" else 0.9)
model, optimizer = fabric.setup(model, optimizer)
for step, (x, y) in enumerate(loader):
    optimizer.zero_grad()
    fabric.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    if step == 3:
        break
"""

# The race forced: rank 0 leaves right after issuing a last all-reduce that rank 1 joins 0.5 s later,
# and the exit handler registered first (so run last) keeps the interpreter lock for a while. Without
# the strategies' end at exit, rank 0 aborts every time (dense DDP in the same script does).
FORCED = """
import atexit
import sys
import time

atexit.register(sum, range(30_000_000))

import torch
import torch.distributed as dist

import lightning_sparse

api, compress = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
if api == "trainer":
    import lightning as L
    from lightning_sparse.demos import DigitsClassifier, DigitsDataModule

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=lightning_sparse.SparseDDPStrategy(compress=compress),
        max_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(DigitsClassifier(lr=0.05, momentum=0.9), datamodule=DigitsDataModule(batch_size=32))
    rank = trainer.global_rank
else:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=lightning_sparse.FabricSparseDDPStrategy(compress=compress))
    fabric.launch()
    model = torch.nn.Linear(64, 32)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(8, 64)).square().mean())
    optimizer.step()
    rank = fabric.global_rank
if rank == 1:
    time.sleep(0.5)
dist.all_reduce(torch.ones(1024), async_op=True)
"""


def _env(log: Path, site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"})
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "EXIT_STRESS_CHILD"):
        env.pop(name, None)
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")]))
    env["EXIT_STRESS_LOG"] = str(log)
    return env


class Runs:
    """Runs commands, each in its own folder, and keeps every process's exit status and what failed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.site = root / "site"
        self.site.mkdir(parents=True, exist_ok=True)
        (self.site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.exits: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.count = 0

    def run(self, cmd: list[str], processes: int, timeout: float = 300) -> None:
        self.count += 1
        where = self.root / f"run{self.count}"
        log = where / "exits"
        log.mkdir(parents=True)
        label = " ".join(cmd[1:])
        try:
            proc = subprocess.run(
                cmd, cwd=where, env=_env(log, self.site), capture_output=True, text=True, timeout=timeout
            )
            returncode, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as error:
            returncode, out = None, f"timed out after {timeout} s\n{error.stderr or ''}"
        exits = [json.loads(path.read_text()) for path in sorted(log.glob("*.json"))]
        self.exits += exits
        codes = sorted(e["code"] for e in exits)
        if returncode != 0 or codes != [0] * processes or "terminate called" in out or "Fatal Python" in out:
            self.failures.append(f"{label}: return code {returncode}, exit codes {codes}\n{out[-3000:]}")

    def check(self) -> None:
        bad = [e for e in self.exits if e["code"] != 0]
        print(f"{self.count} runs, {len(self.exits)} process exits, {len(bad)} not 0")
        assert not self.failures, f"{len(self.failures)} of {self.count} runs failed:\n" + "\n\n".join(self.failures)


@pytest.fixture
def runs(tmp_path: Path) -> Runs:
    return Runs(tmp_path)


def _sizes(sizes: tuple[tuple[int, int], ...] = EXAMPLE_SIZES) -> list[int]:
    return [processes for processes, repeats in sizes for _ in range(repeats)]


def test_train_digits_exits(runs: Runs) -> None:
    """``examples/train_digits.py`` (Trainer: dense DDP, then sparse_ddp), one epoch."""
    for compress in MODES:
        for processes in _sizes():
            cmd = [sys.executable, str(EXAMPLES / "train_digits.py"), "--epochs", "1", "--devices", str(processes)]
            runs.run([*cmd, "--compress", compress], processes)
    runs.check()


def test_cli_exits(runs: Runs) -> None:
    """``examples/cli.py fit`` (Lightning CLI, a config of examples/configs/), a few steps."""
    for compress in MODES:
        for processes in _sizes():
            cmd = [sys.executable, str(EXAMPLES / "cli.py"), "fit", "--config", str(EXAMPLES / "configs" / "topk.yaml")]
            cmd += ["--trainer.devices", str(processes), "--trainer.max_steps", "4", "--trainer.limit_val_batches", "2"]
            runs.run([*cmd, "--trainer.strategy.init_args.compress", compress], processes)
    runs.check()


def test_fabric_digits_exits(runs: Runs) -> None:
    """``examples/fabric_digits.py`` (Fabric; update mode, the example's only one), one epoch."""
    for processes in _sizes():
        cmd = [sys.executable, str(EXAMPLES / "fabric_digits.py"), "--epochs", "1", "--devices", str(processes)]
        runs.run(cmd, processes)
    runs.check()


@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_user_script_exits(runs: Runs, api: str) -> None:
    """A user's script that ends the process group nowhere: the strategy does it at exit."""
    script = runs.root / f"user_{api}.py"
    script.write_text(USER_TRAINER if api == "trainer" else USER_FABRIC)
    for compress in MODES:
        for processes in _sizes(USER_SIZES):
            runs.run([sys.executable, str(script), str(processes), compress], processes)
    runs.check()


def test_forced_race_exits(runs: Runs) -> None:
    """The last collective completes while rank 0 is leaving, with the interpreter lock held at exit."""
    script = runs.root / "forced.py"
    script.write_text(FORCED)
    for api in ("trainer", "fabric"):
        for compress in MODES:
            for _ in range(3):
                runs.run([sys.executable, str(script), api, compress], 2)
    runs.check()
