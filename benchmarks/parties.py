"""What grows with the number of parties: the gap to dense DDP and the exchange's inner figures.

    python -m benchmarks parties                                   # 2, 4 and 8 processes
    python -m benchmarks parties --parties 2 4 --samples 9600 --json parties.json

For each number of processes (parties) it trains the same GPT (``lightning_sparse.demos.gpt.TinyGPT``,
``--width``, ``--layers``) on standard-library source in a Fabric loop (AdamW lr 1e-3, betas (0.9,
0.95), 10 % warm-up then cosine, gradient norm clipped at 1, batch 16 per process), or with ``--task
text`` the text task's GRU (``lightning_sparse.demos.text.NextCharClassifier``: SGD lr 0.2, momentum
0.9, cosine to 0, clipped at 1, batch 64 per process, 16 characters of context), each process on
its own shard of the same training windows, for ``--samples`` windows in all: the same samples at
every number of parties, so 4 parties take half the steps of 2. Rows, one after the other in the
same processes: dense DDP, ``SparseDDPStrategy()`` (update mode, top-k 1 %, every step) and
``sync_every=4, value_bits=2, warmup_steps=0``; ``--variants`` adds rows of other settings (the
strategy's arguments as JSON; ``"outer_lr": c`` makes the outer step an SGD step of learning rate c,
which adds c times the average; ``"lr": x`` sets AdamW's learning rate; ``{"dense": true, "lr": x}``
is dense DDP at another learning rate; ``{"diloco": H}`` is torchft's DiLoCo with ``H`` inner steps
per outer step, Nesterov outer step of lr 0.7 and momentum 0.9, which needs ``pip install -e
".[bench]"``; ``"flush": true`` or ``R`` ends the row with ``flush_residuals()``, dense or in R rounds;
``"clip": c`` clips each process's gradient norm at c, 0 not at all (default 1);
``"noise_correct": true`` (AdamW) scales each coordinate's step of every party by ``sqrt(v / v')``,
``v' = m^2 + (v - m^2) / N``: a probe of the step each party would take if it normalised by the second
moment of the parties' averaged gradient; ``"clip_by": "exact"`` (a probe) clips each party's gradient
by the norm of the parties' averaged gradient (a dense all-reduce the bytes do not count), ``"local"``
by an estimate of it from the party's AdamW moments; ``"own_share": s`` (a probe; ``"parties"``: 1/N)
runs each party's forward, backward and step at ``global + s * e`` instead of ``global + e``;
``"chosen_scale": 1.0`` adds the plain average, as the default did before it scaled the coordinates
each party chose on its own; ``"compress": "gradient"`` rows run as dense DDP's, without
the inner figures), ``--only`` keeps some rows (dense DDP always runs: the gaps are against it).

Per row: the validation loss at the end (the global model, 512 windows of modules never trained on)
and its gap to dense DDP's at the same number of parties; the gap of the virtual model, the global
model plus the mean of the residuals (where the average of everything each party made would be);
and, averaged over the fit,

- ``step``: the norm of the global model's change per optimizer step, against dense DDP's;
- ``resid``: the residuals' norm against the parameters' (mean over processes);
- ``apart``: how far the processes' views are apart, ``||e_i - mean e||`` against the parameters'
  norm (their views are the global model plus their residuals);
- ``one``: of the coordinates the average moved, the share that one party alone sent;
- ``v``: the mean of AdamW's second moment (``exp_avg_sq``) against dense DDP's;

and the bytes one process sent: its messages (the strategy's telemetry), the float32 tensors DDP
or torchft's DiLoCo hands to its all-reduce.

These figures come from the processes' own tensors after each exchange (``sync_every=1`` rows every
step; with local steps at each exchange), through extra all-reduces that the bytes do not count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._ranks import checkout_env, free_port, run_ranks

#: task -> the training windows of a run, at every number of parties
SAMPLES = {"gpt": 19200, "text": 51200}
#: task -> the batch per process
BATCH = {"gpt": 16, "text": 64}

#: row -> strategy settings (None: dense DDP)
ROWS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "default": {},
    "every4": {"sync_every": 4, "value_bits": 2, "warmup_steps": 0},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parties", type=int, nargs="+", default=[2, 4, 8], help="(default: 2 4 8)")
    parser.add_argument(
        "--task",
        choices=["gpt", "text"],
        default="gpt",
        help="the GPT (AdamW) or the text task's GRU (SGD with momentum)",
    )
    parser.add_argument(
        "--samples", type=int, default=None, help="training windows in all (default: 19200 for gpt, 51200 for text)"
    )
    parser.add_argument("--width", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variants", nargs="*", default=[], metavar="NAME=JSON", help="more rows: 'wide={\"density\": 0.02}'"
    )
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME", help="run only these rows (and dense)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for one number of parties")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows", default=None, help=argparse.SUPPRESS)


def _rows(args: argparse.Namespace) -> dict[str, dict[str, Any] | None]:
    rows = dict(ROWS)
    for spec in args.variants:
        name, _, settings = spec.partition("=")
        if not name or not settings:
            raise SystemExit(f"--variants {spec!r} is not allowed: expected NAME=JSON")
        rows[name] = json.loads(settings)
    if args.only is not None:
        unknown = sorted(set(args.only) - set(rows))
        if unknown:
            raise SystemExit(f"--only {unknown} is not allowed: the rows are {sorted(rows)}")
        rows = {name: s for name, s in rows.items() if name == "dense" or name in args.only}
    return rows


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args)
    rows = _rows(args)
    args.samples = args.samples or SAMPLES[args.task]
    results: dict[str, Any] = {
        "task": args.task, "samples": args.samples, "width": args.width, "layers": args.layers, "parties": {}
    }  # fmt: skip
    for n in args.parties:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            port = free_port()
            cmds = [
                [sys.executable, "-m", "benchmarks", "parties", "--worker", "--rank", str(r), "--world", str(n),
                 "--port", str(port), "--out", str(out), "--rows", json.dumps(rows), "--samples", str(args.samples),
                 "--width", str(args.width), "--layers", str(args.layers), "--seed", str(args.seed),
                 "--task", args.task]
                for r in range(n)
            ]  # fmt: skip
            codes, timed_out = run_ranks(cmds, checkout_env(dict(os.environ)), [out / f"log{r}" for r in range(n)],
                                         args.timeout)  # fmt: skip
            if timed_out or any(codes) or not (out / "rank0.json").exists():
                print((out / "log0").read_text()[-3000:], file=sys.stderr)
                raise SystemExit(f"{n} parties failed: exit codes {codes}, timed out: {timed_out}")
            results["parties"][str(n)] = json.loads((out / "rank0.json").read_text())
        print(format_table(results, n), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def format_table(results: dict[str, Any], n: int) -> str:
    """One markdown table of the rows at ``n`` parties."""
    rows = results["parties"][str(n)]
    dense = rows["dense"]
    lines = [
        f"{results.get('task', 'gpt')}: {n} parties, {rows['dense']['steps']} steps each",
        "| run | val loss | gap | virtual gap | step / dense | resid | apart | one | v / dense | MB sent |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():

        def ratio(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key] / dense[key]:.2f}" if dense[key] else "-"

        lines.append(
            f"| {name} | {r['val_loss']:.4f} | {r['val_loss'] - dense['val_loss']:+.4f} | "
            f"{r['virtual_loss'] - dense['val_loss']:+.4f} | {ratio('step')} | "
            f"{r['resid']:.3f} | {r['apart']:.3f} | {r['one']:.2f} | {ratio('v')} | "
            f"{r['bytes'] / 1e6 if 'bytes' in r else math.nan:.3g} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- one process
def worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lightning_sparse import end_process_group

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), WORLD_SIZE=str(args.world),
                      NODE_RANK="0", LOCAL_RANK=str(args.rank), RANK=str(args.rank))  # fmt: skip
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=timedelta(seconds=600))
    figures = {name: run_row(args, settings) for name, settings in json.loads(args.rows).items()}
    if args.rank == 0:
        (Path(args.out) / "rank0.json").write_text(json.dumps(figures))
    end_process_group(exit_code=0)
    return 0


def run_row(args: argparse.Namespace, settings: dict[str, Any] | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from lightning_sparse.demos.gpt import TinyGPT, load_gpt_tensors, warmup_cosine
    from lightning_sparse.demos.text import NextCharClassifier, load_text_tensors
    from lightning_sparse.fabric import SparseDDPStrategy

    world, rank, batch = args.world, args.rank, BATCH[args.task]
    settings = dict(settings) if settings is not None else None
    lr = settings.pop("lr", None) if settings is not None else None
    diloco_h = settings.pop("diloco", None) if settings is not None else None
    flush = settings.pop("flush", None) if settings is not None else None  # true: dense; R: R rounds
    noise = settings.pop("noise_correct", None) if settings is not None else None
    clip = settings.pop("clip", 1.0) if settings is not None else 1.0  # 0: no clipping
    clip_by = settings.pop("clip_by", "own") if settings is not None else "own"
    own_share = settings.pop("own_share", None) if settings is not None else None
    if settings is not None and (settings.pop("dense", False) or diloco_h is not None):
        settings = None  # dense DDP at another learning rate, or DDP without its all-reduce for DiLoCo
    if settings is not None and "chosen_scale" in settings:  # the chosen coordinates' factor alone
        from lightning_sparse.exchange.outer import AddAverage

        settings["outer_optimizer"] = AddAverage(chosen_scale=settings.pop("chosen_scale"))
    if settings is not None and "outer_lr" in settings:  # an outer SGD step of this learning rate
        import functools

        settings = dict(settings)
        settings["outer_optimizer"] = functools.partial(torch.optim.SGD, lr=settings.pop("outer_lr"))
    devices = [torch.device("cpu")] * world
    strategy: Any = (
        DDPStrategy(parallel_devices=devices, process_group_backend="gloo")
        if settings is None
        else SparseDDPStrategy(parallel_devices=devices, process_group_backend="gloo", **settings)
    )
    fabric = Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    torch.manual_seed(args.seed)
    steps = args.samples // (batch * world)
    model: Any
    if args.task == "gpt":
        model = TinyGPT(context=32, width=args.width, layers=args.layers, heads=4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr or 1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps))
        train, val = load_gpt_tensors(context=32, n_train=args.samples, n_val=512, seed=args.seed)
    else:  # the text task's GRU as its Trainer runs it: SGD with momentum, cosine to 0
        model = NextCharClassifier()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr or 0.2, momentum=0.9)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        train, val = load_text_tensors(context=16, n_train=args.samples, n_val=4096, seed=args.seed)
    if noise:
        _noise_correct(optimizer, world if noise is True else float(noise))
    model, optimizer = fabric.setup(model, optimizer)
    order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(args.seed + 1))
    mine = order[rank::world]  # every process its own shard of the same windows
    params = list(model.parameters())
    update_mode = settings is not None and strategy._core.update is not None
    if own_share is not None:
        _own_share(model, optimizer, strategy, 1.0 / world if own_share == "parties" else float(own_share))
    probe = _Probe(strategy if update_mode else None, params, world)  # gradient mode: as dense DDP
    peer = None
    if diloco_h is not None:  # torchft's DiLoCo: each process a replica group of its own
        from benchmarks.torchft_peer import DiLoCoPeer

        peer = DiLoCoPeer(int(diloco_h))
        peer.start(rank, world, fabric.broadcast, model.module, optimizer.optimizer)
        peer.counter.start()  # the bytes of the pseudo-gradients' all-reduces
    for step in range(steps):
        idx = mine[step * batch : (step + 1) * batch]
        x, y = train.tensors[0][idx], train.tensors[1][idx]
        logits = model(x)
        loss = _loss(logits, y)
        with fabric.no_backward_sync(model, enabled=peer is not None):  # DiLoCo: the process's own gradient
            fabric.backward(loss)
        if clip and clip_by != "own" and settings is not None:
            _clip_by_average(params, optimizer, clip, world, clip_by)
        elif clip:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        probe.before()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if peer is not None:
            peer.after_step(model.module)
        else:
            probe.after(optimizer)
    if settings is not None:
        strategy.global_model()
        if flush is not None and flush is not False:
            strategy.flush_residuals(None if flush is True else int(flush))
    if peer is not None:  # validation sees the parameters of the last outer step
        with torch.no_grad():
            for p, g in zip(params, peer.global_params, strict=True):
                p.copy_(g)
        peer.close()
    model.eval()
    vx, vy = val.tensors
    with torch.no_grad():
        val_loss = float(_loss(model(vx), vy))
        virtual = val_loss
        if update_mode:  # the global model plus the mean of the residuals: what dense-like
            update = strategy._core.update  # averaging of everything each party made would hold
            mean_e = probe._residuals()
            dist.all_reduce(mean_e)
            mean_e /= world
            pos = 0
            for p in update._params.values():
                p.add_(mean_e[pos : pos + p.numel()].view_as(p))
                pos += p.numel()
            virtual = float(_loss(model(vx), vy))
    model.train()
    dist.barrier()
    if peer is not None:  # what torchft's process group was handed to all-reduce
        sent = peer.counter.bytes
    elif settings is not None:  # the messages this process sent
        sent = strategy.sparse_state.telemetry.total.sent_bytes
    else:  # DDP hands every step's float32 gradient to its all-reduce
        sent = steps * sum(4 * p.numel() for p in params)
    return {"steps": steps, "val_loss": val_loss, "virtual_loss": virtual, **probe.summary(), "bytes": sent}


def _noise_correct(optimizer: Any, parties: float) -> None:
    """Probe: scale each coordinate's AdamW step by sqrt(v / v'), v' = m^2 + (v - m^2) / parties: the
    step each party would take if its second moment were that of the parties' averaged gradient."""
    import torch

    before: list[Any] = []

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        before[:] = [p.detach().clone() for g in opt.param_groups for p in g["params"]]

    @torch.no_grad()
    def post(opt: Any, args: Any, kwargs: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        b1, b2 = opt.param_groups[0]["betas"]
        for p, old in zip(params, before, strict=True):
            state = opt.state.get(p)
            if not state:
                continue
            step = float(state["step"])
            m = state["exp_avg"] / (1 - b1**step)
            v = state["exp_avg_sq"] / (1 - b2**step)
            m2 = m * m
            v_avg = m2 + (v - m2).clamp_min(0) / parties
            f = (v / v_avg.clamp_min(1e-30)).sqrt().clamp(1.0, parties**0.5)
            p.copy_(old + f * (p - old))

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)


def _own_share(model: Any, optimizer: Any, strategy: Any, share: float) -> None:
    """Probe: each party's forward, backward and step at ``global + share * e`` instead of ``global + e``
    (the progress it hands the exchange is the same ``p - view``)."""
    import torch

    update = strategy._core.update
    held: list[Any] = []

    @torch.no_grad()
    def shift(sign: float) -> None:
        memory = update.state.memory
        for name, p in update._params.items():
            e = memory.get(name) if name in memory else None
            if e is not None:
                p.add_(e.view_as(p), alpha=sign * (1.0 - share))

    def pre_forward(module: Any, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and not held:
            shift(-1.0)
            held.append(True)

    def post_step(opt: Any, args: Any, kwargs: Any) -> None:
        if held:
            shift(1.0)
            held.clear()

    model.module.register_forward_pre_hook(pre_forward)  # after the strategy's (prepended) hook
    optimizer.optimizer.register_step_post_hook(post_step)


def _clip_by_average(params: list[Any], optimizer: Any, clip: float, parties: int, how: str) -> None:
    """Probe: clip each party's gradient by the norm of the parties' averaged gradient: exactly
    (``"exact"``, a dense all-reduce) or estimated from the party's AdamW moments (``"local"``:
    ``|g|^2 * (1 - (1 - 1/N) * noise / sum(v))``, the noise ``sum(v - m^2)`` less what the EMA ``m``
    still holds of it)."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if how == "exact":
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        norm = float(flat.norm()) / parties
    else:
        b1, b2 = optimizer.param_groups[0]["betas"]
        total = noise = 0.0
        for s in optimizer.state.values():
            if "exp_avg_sq" not in s:
                continue
            step = float(s["step"])
            m = s["exp_avg"] / (1 - b1**step)
            v = s["exp_avg_sq"] / (1 - b2**step)
            total += float(v.sum())
            noise += float((v - m * m).clamp_min(0).sum())
        noise /= 1 - (1 - b1) / (1 + b1)  # the noise left in the EMA m
        rho = 1.0 if total == 0 else max(1.0 / parties, 1 - min(noise, total) / total * (1 - 1 / parties))
        own = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        norm = own * rho**0.5
    factor = min(1.0, clip / (norm + 1e-6))
    with torch.no_grad():
        for g in grads:
            g.mul_(factor)


def _loss(logits: Any, targets: Any) -> Any:
    """Cross-entropy over every predicted position (the GPT's ``(B, T, V)``, the GRU's ``(B, V)``)."""
    from torch import nn

    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _Probe:
    """The inner figures, read after each exchange (dense DDP: every step)."""

    def __init__(self, strategy: Any, params: list[Any], world: int) -> None:
        import torch

        self.strategy, self.params, self.world = strategy, params, world
        self.series: dict[str, list[float]] = {"step": [], "resid": [], "apart": [], "one": [], "v": []}
        self._flat = lambda tensors: torch.cat([t.detach().reshape(-1).float() for t in tensors])
        self._before: Any = None
        self._progressed: Any = None  # the process's parameters as its optimizer left them
        if strategy is not None:
            update = strategy._core.update
            exchange = update.exchange

            def watched(*a: Any, **k: Any) -> Any:
                self._progressed = self._flat(update._params.values())
                return exchange(*a, **k)

            update.exchange = watched

    def _residuals(self) -> Any:
        import torch

        memory = self.strategy._core.state.memory
        update = self.strategy._core.update
        out = []
        for name in update._params:
            e = memory.get(name) if name in memory else None
            out.append(e.reshape(-1).float() if e is not None else torch.zeros(update._params[name].numel()))
        return torch.cat(out)

    def before(self) -> None:
        if self.strategy is None:
            self._before = self._flat(self.params)
            return
        update = self.strategy._core.update
        self._before = self._flat(update._global[n] if n in update._global else p for n, p in update._params.items())

    def after(self, optimizer: Any) -> None:
        import torch
        import torch.distributed as dist

        if self.strategy is None:
            now = self._flat(self.params)
        else:
            update = self.strategy._core.update
            now = self._flat(update._global[n] if n in update._global else p for n, p in update._params.items())
        moved = now - self._before
        if self.strategy is not None and not bool(moved.any()):
            return  # a local step: no exchange
        self.series["step"].append(float(moved.norm()))
        v = [s["exp_avg_sq"] for s in optimizer.state.values() if "exp_avg_sq" in s]
        if v:
            self.series["v"].append(float(self._flat(v).mean()))
        if self.strategy is None:
            return
        norm = float(now.norm())
        e = self._residuals()
        self.series["resid"].append(float(e.norm()) / norm)
        mean_e = e.clone()
        dist.all_reduce(mean_e)
        mean_e /= self.world
        self.series["apart"].append(float((e - mean_e).norm()) / norm)
        # what this process sent: its parameters as its optimizer left them are global_old + u
        # (u = e_old + progress), and u = sent + e_new; unsent coordinates differ by rounding only
        sent_values = self._progressed - self._before - e
        sent = sent_values.abs() > 1e-6 * self._progressed.abs() + 1e-12
        count = sent.to(torch.int32)
        dist.all_reduce(count)
        moved_any = count > 0
        self.series["one"].append(float((count == 1).sum()) / max(1, int(moved_any.sum())))

    def summary(self) -> dict[str, float]:
        return {k: (statistics.fmean(v) if v else math.nan) for k, v in self.series.items()}
