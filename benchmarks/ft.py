"""Goodput of fault-tolerant replica groups under repeated failures: 3 groups on CPUs, killed in turn.

Two fits of 3 replica groups of 1 process each (``fault_tolerant=True``, gloo, a torchft
Lighthouse on the loopback, a small MLP regression or, with ``--model gpt``, the TinyGPT (2 blocks of
width 64) on standard-library source, ``sync_every`` and ``value_bits`` as given): one without
failures, one where at each of ``--kills`` (fractions of the run) the next group (2, then 0, then 1)
is SIGKILLed and started again at once with the same command (after the group restarted before has
committed an exchange). Reported, against the fit without failures: the survivors' steps per second
while a group is down (from its kill to its first committed exchange after the restart) and before
the first kill, that time itself, the run's steps per wall second (``max_steps`` over the wall time),
the useful steps per wall second (every process's steps up to its last committed exchange: a killed
process's steps after its last commit, and a group's absence, count as lost), each group's final
validation loss, and whether the global models ended bit-identical. Needs the optional package:
``pip install -e ".[ft]"``.
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
    parser.add_argument("--steps", type=int, default=960, help="max_steps of every group")
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--value-bits", type=int, default=2)
    parser.add_argument(
        "--kills", type=str, default="0.1,0.35,0.6",
        help="fractions of --steps at which a group is killed and at once started again (groups 2, 0, 1, ...)",
    )  # fmt: skip
    parser.add_argument("--step-sleep", type=float, default=0.1, help="seconds added to every training step")
    parser.add_argument(
        "--join-timeout-ms", type=int, default=1000,
        help="the Lighthouse's --join_timeout_ms: how long a quorum whose members changed waits for groups that "
        "heartbeat but have not asked (a group just killed counts as one until its heartbeats lapse)",
    )  # fmt: skip
    parser.add_argument(
        "--heartbeat-timeout-ms", type=int, default=300,
        help="the Lighthouse's --heartbeat_timeout_ms: how long after a group's last heartbeat it stops counting it "
        "as live (torchft's Manager sends one every 100 ms)",
    )  # fmt: skip
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
    """Every step: the Trainer's step, the exchanges this process committed and the time, one line each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(trainer.global_step)
        commits = getattr(trainer.strategy.update_exchange, "commits", 0)  # type: ignore[attr-defined]
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step} {commits} {time.time():.3f}\n")


def _fit_group(cfg: dict[str, Any]) -> None:
    """One replica group's fit (run in its own process by :func:`run`)."""
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    group = int(os.environ["REPLICA_GROUP_ID"])
    out = Path(cfg["out"])
    strategy = lightning_sparse.SparseDDPStrategy(
        fault_tolerant=True, sync_every=cfg["sync_every"], value_bits=cfg["value_bits"], density=0.1, min_numel=0,
        quorum_timeout=30.0,
    )  # fmt: skip
    progress = _Progress(out / f"progress_g{group}_{os.environ['BENCH_FT_START']}.txt")
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
        "heals": getattr(update, "heals", 0),
        "rollbacks": getattr(update, "rollbacks", 0),
        "params": [p.detach().clone() for p in module.parameters()],
    }
    torch.save(figures, out / f"result_g{group}.pt")
    if update is not None and hasattr(update, "close"):
        update.close()


def _read(path: Path) -> list[tuple[int, int, float]]:
    """A progress file's lines: (step, commits, time)."""
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(a), int(b), float(c)) for a, b, c in (r for r in rows if len(r) == 3)]


def _fit(out: Path, args: argparse.Namespace, kills: list[float]) -> dict[str, Any]:
    """One fit of the groups: each kill (a fraction of the run) SIGKILLs the next group (2, 0, 1, ...)
    when it reaches that step, after the group restarted before it has committed an exchange, and
    starts it again at once. Returns the groups' results, their progress files and the times."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"out": str(out), "steps": args.steps, "sync_every": args.sync_every, "value_bits": args.value_bits,
           "step_sleep": args.step_sleep, "model": args.model}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    port = free_port()
    script = Path(sys.executable).parent / "torchft_lighthouse"
    lighthouse = subprocess.Popen(
        [str(script) if script.exists() else "torchft_lighthouse", "--min_replicas", "2" if kills else str(GROUPS),
         "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", str(args.join_timeout_ms),
         "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms), "--quorum_tick_ms", "50"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    procs: dict[int, subprocess.Popen[bytes]] = {}
    starts = dict.fromkeys(range(GROUPS), 0)
    killed: list[subprocess.Popen[bytes]] = []

    def start(group: int) -> None:
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "REPLICA_GROUP_ID": str(group),
               "NUM_REPLICA_GROUPS": str(GROUPS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1", "BENCH_FT_START": str(starts[group])}  # fmt: skip
        log = open(out / f"log_g{group}_{starts[group]}.txt", "wb")
        cmd = [sys.executable, "-m", "benchmarks", "ft", "--group", str(out / "config.json")]
        procs[group] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def last(group: int) -> tuple[int, int, float]:
        rows = _read(out / f"progress_g{group}_{starts[group]}.txt")
        return rows[-1] if rows else (0, 0, 0.0)

    def wait(ready: Any, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > end:
                raise TimeoutError(f"groups at steps {[last(g)[0] for g in range(GROUPS)]}")
            time.sleep(0.02)

    events: list[dict[str, Any]] = []
    began = time.time()
    try:
        for g in range(GROUPS):
            start(g)
        for k, fraction in enumerate(kills):
            victim = (GROUPS - 1 + k) % GROUPS
            if events:  # the group restarted before has committed an exchange (it healed and rejoined)
                wait(lambda: last(events[-1]["group"])[1] >= 1)
            wait(lambda v=victim, at=int(fraction * args.steps): last(v)[0] >= at)
            os.killpg(procs[victim].pid, signal.SIGKILL)
            at = time.time()
            killed.append(procs[victim])
            procs[victim].wait(timeout=10)
            events.append({"group": victim, "killed_at": at, "step": last(victim)[0], "start": starts[victim]})
            starts[victim] += 1
            start(victim)
        late = []  # restarted groups that came back after the run was over (they exit saying so)
        for g, p in procs.items():
            if p.wait(timeout=600) != 0:
                logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob(f"log_g{g}_*.txt")))
                if "the run is over" not in logs:
                    raise RuntimeError(f"group {g} failed:\n{logs}")
                late.append(g)
        wall = time.time() - began
        results = [torch.load(out / f"result_g{g}.pt", weights_only=False) for g in range(GROUPS) if g not in late]
        progress = {(g, n): _read(out / f"progress_g{g}_{n}.txt") for g in range(GROUPS) for n in range(starts[g] + 1)}
        return {"results": results, "progress": progress, "events": events, "wall": wall, "late": late}
    finally:
        for p in [*procs.values(), *killed]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        lighthouse.kill()
        lighthouse.wait(timeout=10)


def _useful(rows: list[tuple[int, int, float]]) -> int:
    """A process's steps that reached the global model: those up to its last committed exchange."""
    committed = [i for i, (_, commits, _) in enumerate(rows) if commits > (rows[i - 1][1] if i else 0)]
    return committed[-1] + 1 if committed else 0


def _rate(rows: list[tuple[int, int, float]], t0: float, t1: float) -> float | None:
    """Steps per second of one process between the times ``t0`` and ``t1``."""
    inside = [(step, t) for step, _, t in rows if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        return None
    return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])


def figures(clean: dict[str, Any], faulty: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The comparison of the two fits.

    Example:
        >>> rows = [(s, s // 2, 100.0 + s) for s in range(1, 9)]
        >>> r = {"val_loss": 0.1, "heals": 0, "params": [torch.zeros(2)]}
        >>> fit = {"results": [r] * 3, "progress": {(g, 0): rows for g in range(3)}, "events": [], "wall": 10.0}
        >>> out = figures(fit, fit, argparse.Namespace(steps=8))
        >>> out["useful_steps_per_s_ratio"], out["identical_global_models"]
        (1.0, True)
    """
    events, progress = faulty["events"], faulty["progress"]
    healed, during, before = [], [], []
    first_kill = events[0]["killed_at"] if events else float("inf")
    for event in events:
        g = event["group"]
        back = [t for _, commits, t in progress[(g, event["start"] + 1)] if commits >= 1]
        heal_at = back[0] if back else float("inf")  # None: it came back after the run was over
        healed.append(round(heal_at - event["killed_at"], 2) if back else None)
        for s in range(GROUPS):
            if s == g:
                continue
            rows = [r for (h, _), rs in progress.items() if h == s for r in rs]
            if (rate := _rate(rows, event["killed_at"], heal_at)) is not None:
                during.append(rate)
    for rows in progress.values():
        steady = [t for _, commits, t in rows if commits >= 2]
        if steady and (rate := _rate(rows, steady[0], first_kill)) is not None:
            before.append(rate)
    useful = {name: sum(_useful(rows) for rows in fit["progress"].values()) / fit["wall"]
              for name, fit in (("clean", clean), ("faulty", faulty))}  # fmt: skip
    first = faulty["results"][0]["params"]
    identical = all(all(torch.equal(a, b) for a, b in zip(first, r["params"], strict=True)) for r in faulty["results"])
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "kills": [{"group": e["group"], "at_step": e["step"]} for e in events],
        "kill_to_first_commit_s": healed,
        "survivor_steps_per_s_before": round(mean(before), 2),
        "survivor_steps_per_s_during_failures": round(mean(during), 2) if during else None,
        "survivor_rate_ratio": round(mean(during) / mean(before), 3) if during and before else None,
        "run_steps_per_s": {
            "clean": round(args.steps / clean["wall"], 2),
            "faulty": round(args.steps / faulty["wall"], 2),
        },
        "useful_steps_per_s": {k: round(v, 2) for k, v in useful.items()},
        "useful_steps_per_s_ratio": round(useful["faulty"] / useful["clean"], 3),
        "wall_s": {"clean": round(clean["wall"], 1), "faulty": round(faulty["wall"], 1)},
        "val_loss_clean": [round(r["val_loss"], 4) for r in clean["results"]],
        "val_loss_faulty": [round(r["val_loss"], 4) for r in faulty["results"]],
        "identical_global_models": identical,
        "heals": [r["heals"] for r in faulty["results"]],
        "groups_back_after_the_end": faulty.get("late", []),
    }


def run(args: argparse.Namespace) -> int:
    """Run the command: the two fits, then print (and optionally write) the figures."""
    if args.group is not None:
        _fit_group(json.loads(Path(args.group).read_text()))
        return 0
    require_torchft()
    kills = [float(f) for f in args.kills.split(",") if f.strip()]
    if not kills or not all(0 < f < 1 for f in kills):
        raise ValueError(f"--kills={args.kills!r} is not allowed: expected fractions of the run between 0 and 1.")
    with tempfile.TemporaryDirectory() as tmp:
        clean = _fit(Path(tmp) / "clean", args, [])
        faulty = _fit(Path(tmp) / "faulty", args, kills)
    out = figures(clean, faulty, args)
    for name, value in out.items():
        print(f"{name:38s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
