"""What a failure costs fault-tolerant replica groups: 3 groups on CPUs, one killed mid-fit and restarted.

Two fits of 3 replica groups of 1 process each (``fault_tolerant=True``, gloo, a torchft
Lighthouse on the loopback, a small MLP regression or, with ``--model gpt``, the TinyGPT (2 blocks of
width 64) on standard-library source, ``sync_every`` and ``value_bits`` as given):
one without failures, one where group 2 is SIGKILLed at ``--kill-at`` and started again
``--restart-after`` steps of group 0 later (the same command). Reported: steps lost per failure
(steps the survivors repeated or skipped, and the steps the killed group did not train between
its death and its healing), seconds the live groups waited in quorums (against the fit without
failures), each group's final validation loss, whether the global models ended bit-identical, and
the bytes each group put into the exchange. Needs the optional package: ``pip install -e ".[ft]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sparse
from lightning_sparse._utils import free_port
from lightning_sparse.exchange.ft_env import require_torchft

DIM, HIDDEN, GROUPS = 16, 32, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp", help="what the groups train")
    parser.add_argument("--steps", type=int, default=240, help="max_steps of every group")
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--value-bits", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=60, help="group 2 is killed when it reaches this step")
    parser.add_argument("--restart-after", type=int, default=20, help="steps of group 0 before the restart")
    parser.add_argument("--step-sleep", type=float, default=0.1, help="seconds added to every training step")
    parser.add_argument("--json", type=str, default=None, help="also write the figures here")
    parser.add_argument("--group", type=str, default=None, help=argparse.SUPPRESS)  # a group's own fit


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g))


class _Net(L.LightningModule):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
        self.sleep = sleep

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.sleep)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _task(model: str, sleep: float) -> tuple[L.LightningModule, TensorDataset, Any]:
    """The module, its training set and its validation loss (a function of the module)."""
    if model == "mlp":
        val = _data(512, 99)
        net = _Net(sleep)
        return net, _data(4096, 7), lambda m: nn.functional.mse_loss(m.net(val.tensors[0]), val.tensors[1]).item()
    from lightning_sparse.demos.gpt import TinyGPT, load_gpt_tensors

    class _SlowGPT(TinyGPT):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(sleep)
            return super().training_step(batch, batch_idx)

    train, gpt_val = load_gpt_tensors(context=32, n_train=4096, n_val=512, seed=0)
    vx, vy = gpt_val.tensors
    gpt = _SlowGPT(context=32, width=64, layers=2, heads=4, lr=3e-3)
    return gpt, train, lambda m: nn.functional.cross_entropy(m(vx).flatten(0, 1), vy.flatten()).item()


class _Progress(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(trainer.global_step)
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step}\n")


def _fit_group(cfg: dict[str, Any]) -> None:
    """One replica group's fit (run in its own process by :func:`run`)."""
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    group = int(os.environ["REPLICA_GROUP_ID"])
    out = Path(cfg["out"])
    strategy = lightning_sparse.SparseDDPStrategy(
        fault_tolerant=True, sync_every=cfg["sync_every"], value_bits=cfg["value_bits"], density=0.1, min_numel=0,
        quorum_timeout=30.0,  # the first quorum waits for all three to start
    )  # fmt: skip
    progress = _Progress(out / f"progress_g{group}.txt")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=cfg["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[progress],
    )  # fmt: skip
    module, train, loss_of = _task(cfg.get("model", "mlp"), cfg["step_sleep"])
    trainer.fit(module, DataLoader(train, batch_size=16, shuffle=True))
    module.eval()
    with torch.no_grad():
        loss = loss_of(module)
    update = strategy.update_exchange
    figures = {
        "steps": progress.steps,
        "val_loss": loss,
        "quorum_seconds": getattr(update, "quorum_seconds", 0.0),
        "heals": getattr(update, "heals", 0),
        "rollbacks": getattr(update, "rollbacks", 0),
        "bytes": strategy.sparse_state.telemetry.total.sent_bytes,
        "params": [p.detach().clone() for p in module.parameters()],
    }
    torch.save(figures, out / f"result_g{group}.pt")
    if update is not None and hasattr(update, "close"):
        update.close()


def _fit(out: Path, args: argparse.Namespace, kill: bool) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"out": str(out), "steps": args.steps, "sync_every": args.sync_every, "value_bits": args.value_bits,
           "step_sleep": args.step_sleep, "model": args.model}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    port = free_port()
    script = Path(sys.executable).parent / "torchft_lighthouse"
    lighthouse = subprocess.Popen(
        [str(script) if script.exists() else "torchft_lighthouse", "--min_replicas", "2" if kill else str(GROUPS),
         "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000",
         "--quorum_tick_ms", "50"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    procs: dict[int, subprocess.Popen[bytes]] = {}
    killed: list[subprocess.Popen[bytes]] = []

    def start(group: int) -> None:
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "REPLICA_GROUP_ID": str(group),
               "NUM_REPLICA_GROUPS": str(GROUPS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        log = open(out / f"log_g{group}_{len(killed)}.txt", "wb")
        cmd = [sys.executable, "-m", "benchmarks", "ft", "--group", str(out / "config.json")]
        procs[group] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def step(group: int) -> int:
        path = out / f"progress_g{group}.txt"
        lines = path.read_text().split() if path.exists() else []
        return int(lines[-1]) if lines else 0

    def wait(ready: Any, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > end:
                raise TimeoutError(f"groups at steps {[step(g) for g in range(GROUPS)]}")
            time.sleep(0.05)

    try:
        for g in range(GROUPS):
            start(g)
        if kill:
            wait(lambda: step(2) >= args.kill_at)
            os.killpg(procs[2].pid, signal.SIGKILL)
            killed.append(procs[2])
            procs[2].wait(timeout=10)
            (out / "died_at.txt").write_text(str(step(2)))
            at = step(0)
            wait(lambda: step(0) >= at + args.restart_after)
            start(2)
        for g, p in procs.items():
            if p.wait(timeout=600) != 0:
                logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob(f"log_g{g}_*.txt")))
                raise RuntimeError(f"group {g} failed:\n{logs}")
        results = [torch.load(out / f"result_g{g}.pt", weights_only=False) for g in range(GROUPS)]
        if kill:
            results[2]["died_at"] = int((out / "died_at.txt").read_text())
        return results
    finally:
        for p in [*procs.values(), *killed]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        lighthouse.kill()
        lighthouse.wait(timeout=10)


def _lost(steps: list[int], last: int) -> int:
    """Steps a group repeated or skipped (from its first step to ``last``)."""
    return (len(steps) - len(set(steps))) + (last - steps[0] + 1 - len(set(steps)))


def figures(clean: list[dict[str, Any]], faulty: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The comparison of the two fits.

    Example:
        >>> r = {"steps": [1, 2, 3, 4], "val_loss": 0.1, "quorum_seconds": 1.0, "heals": 0, "bytes": 10,
        ...      "params": [torch.zeros(2)]}
        >>> healed = {**r, "steps": [3, 4], "heals": 1, "died_at": 1}
        >>> out = figures([r] * 3, [r, r, healed], argparse.Namespace(steps=4))
        >>> out["survivor_steps_lost"], out["killed_group_steps_not_trained"], out["identical_global_models"]
        (0, 1, True)
    """
    restarted = faulty[2]
    first = faulty[0]["params"]
    identical = all(all(torch.equal(a, b) for a, b in zip(first, r["params"], strict=True)) for r in faulty)
    # the survivors' seconds in quorums beyond the fit without failures (the restarted group's are its own start)
    waited = [f["quorum_seconds"] - c["quorum_seconds"] for f, c in zip(faulty[:2], clean[:2], strict=True)]
    return {
        "survivor_steps_lost": max(_lost(r["steps"], args.steps) for r in faulty[:2]),
        "killed_group_steps_not_trained": restarted["steps"][0] - 1 - restarted["died_at"],
        "survivor_extra_wait_seconds": [round(w, 2) for w in waited],
        "val_loss_clean": [round(r["val_loss"], 4) for r in clean],
        "val_loss_faulty": [round(r["val_loss"], 4) for r in faulty],
        "identical_global_models": identical,
        "heals_of_restarted_group": restarted["heals"],
        "bytes_clean": [r["bytes"] for r in clean],
        "bytes_faulty": [r["bytes"] for r in faulty],
    }


def run(args: argparse.Namespace) -> int:
    """Run the command: the two fits, then print (and optionally write) the figures."""
    if args.group is not None:
        _fit_group(json.loads(Path(args.group).read_text()))
        return 0
    require_torchft()
    with tempfile.TemporaryDirectory() as tmp:
        clean = _fit(Path(tmp) / "clean", args, kill=False)
        faulty = _fit(Path(tmp) / "faulty", args, kill=True)
    out = figures(clean, faulty, args)
    for name, value in out.items():
        print(f"{name:34s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
