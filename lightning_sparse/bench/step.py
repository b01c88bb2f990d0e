"""Step time on a slow link: dense DDP against sparse_ddp with each compressor, in the same run.

    python -m lightning_sparse.bench step --bandwidth 1gbit --world-size 2 --params 25e6
    python -m lightning_sparse.bench step --bandwidth none            # unshaped loopback
    python -m lightning_sparse.bench step --bandwidth 100mbit --latency 1ms --compressors topk randomk

The ranks run a communication-bound model (an MLP of square layers, about ``--params``
parameters, small batches) inside a private network namespace whose loopback is rate-limited
with ``tc`` (tbf, plus netem for ``--latency``): one machine becomes a cluster on a shared link
of that speed. Needs root and iproute2 (``ip``, ``tc``); without them it says so and runs on the
unshaped loopback. ``--bandwidth none`` runs unshaped on purpose.

Every rank builds one DDP model per run (dense DDP, and one per compressor and ``--modes`` entry,
set up exactly as ``SparseDDPStrategy`` sets it up, with the strategy's defaults: the sparse hook
for ``gradient``, the update exchange after the optimizer step for ``update``) from
the same initial weights, and the runs take their steps round-robin: step 1 of every run, then
step 2 of every run, ... so a busy machine slows every run alike. A step is forward, backward
(with DDP's overlapped communication) and the optimizer step, timed from a barrier; a step's
time is the slowest rank's. It prints the median step time of each run and the ratio
dense / run (above 1: faster than dense), with the bytes each rank put into its collectives.

``--peers powersgd[:RANK] fp16 bf16`` adds torch's own DDP communication hooks as rows, on the
same model and link, in the same round-robin: PowerSGD (bucket after bucket, see
:mod:`lightning_sparse.bench.peers`), fp16 and bf16 compression. Their bytes are those of the
tensors the hooks hand to the ``torch.distributed`` collectives (``CollectiveCounter``).

A peer can crash where ours do not (torch's bf16 hook on CPU/gloo, PowerSGD's collectives from
gloo's threads with large models) or hang in a mismatched collective; inside the round-robin one
run's crash would take down every run's figures, and a hang on one rank cannot be recovered from
in-process. So every peer is first *probed*: its ranks run that peer alone, in processes of their
own, for the warm-up steps plus two (PowerSGD compresses from its third step), within
``--probe-timeout`` seconds. A peer whose probe fails or times out becomes a row with its status
(``failed: <reason>``: the exception of a rank that failed on its own rather than one that lost
its peer, or the timeout) and is left out of the timed run; the others join it. Should a probed
peer still bring the timed run down, the run is repeated without the peers, and they are reported
as failed with that reason. The ranks' output is shown after they finish (its tail on a failure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from lightning_sparse._utils import end_process_group, free_port
from lightning_sparse.bench._ranks import run_ranks
from lightning_sparse.bench.peers import PEER_HELP, CollectiveCounter, Peer

DEFAULT_COMPRESSORS = ["topk", "randomk", "rtopk", "gaussiank", "dgc", "randomblock", "countsketch"]
DENSE = "dense DDP"
#: ``--fallback`` -> the sparse runs' ``fallback_to_dense``
FALLBACKS: dict[str, bool | Literal["time"]] = {"bytes": True, "time": "time", "off": False}
#: ``SparseDDPStrategy(exchange=...)``
Exchange = Literal["auto", "allgather", "split"]
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float | None:
    """``"1gbit"`` / ``"100mbit"`` / ``"500kbit"`` -> bits per second; ``"none"`` -> None (unshaped)."""
    t = text.strip().lower()
    if t in ("none", "unshaped", "0"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)", t)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--bandwidth={text!r} is not allowed: expected e.g. 100mbit, 1gbit, 10gbit or none")
    bits = float(m.group(1)) * _UNITS[m.group(2)]
    return bits * 8 if m.group(3) == "bps" else bits  # tc's "bps" means bytes per second


def parse_latency(text: str) -> float:
    """``"1ms"`` / ``"500us"`` / ``"0"`` -> seconds."""
    t = text.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|ms|us)?", t)
    if not m:
        raise ValueError(f"--latency={text!r} is not allowed: expected e.g. 0, 500us, 1ms or 20ms")
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, None: 1e-3}[m.group(2)]
    return float(m.group(1)) * scale


def parse_params(text: str) -> int:
    """``"25e6"`` / ``"25000000"`` -> 25000000 (>= 1e4)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 1e4:
        raise ValueError(f"--params={text!r} is not allowed: expected a number of parameters >= 1e4, e.g. 25e6")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bandwidth", default="1gbit", help="link rate: 100mbit, 1gbit, 10gbit, ... or none")
    parser.add_argument("--latency", default="0", help="added one-way delay per packet: 0, 500us, 1ms, ...")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (processes) on this machine")
    parser.add_argument("--params", default="25e6", help="model size in parameters (default 25e6)")
    parser.add_argument("--layers", type=int, default=6, help="square Linear layers of the MLP")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument(
        "--compressors",
        nargs="+",
        default=DEFAULT_COMPRESSORS,
        help="names, optionally with arguments: rtopk:r_factor=2",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["update", "gradient"],
        default=["update", "gradient"],
        help="what the sparse runs compress, SparseDDPStrategy(compress=MODE) (default: %(default)s)",
    )
    parser.add_argument(
        "--exchanges",
        nargs="+",
        choices=["auto", "allgather", "split"],
        default=["auto"],
        help="how top-k-type selections are combined, SparseDDPStrategy(exchange=...); other compressors "
        "run once (default: %(default)s)",
    )
    parser.add_argument(
        "--fallback",
        choices=list(FALLBACKS),
        default="bytes",
        help="the sparse runs' fallback_to_dense: bytes (the default, True), time, or off (False)",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=[],
        metavar="PEER",
        help=f"torch's DDP comm hooks as extra rows: {PEER_HELP}; bare powersgd: rank 4 (default: none)",
    )
    parser.add_argument(
        "--probe-timeout",
        type=float,
        default=300.0,
        help="seconds a peer's probe (its ranks alone, a few steps) may take before it counts as failed",
    )
    parser.add_argument("--no-dense", action="store_true", help="leave out the dense DDP run (ratios then absent)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run first (bucket rebuild, caches)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the worker runs the peers only
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)


# --------------------------------------------------------------------------- the shaped link
class ShapedLink:
    """A network namespace whose loopback is limited to ``rate`` bits/s (tbf) with ``delay`` s (netem).

    Use as a context manager; :meth:`wrap` prefixes a command so it runs inside the namespace.
    The namespace is deleted on exit, whatever happened.
    """

    def __init__(self, rate_bits: float, delay_s: float = 0.0) -> None:
        self.rate_bits = rate_bits
        self.delay_s = delay_s
        self.name = f"lsbench{os.getpid()}"

    @staticmethod
    def unavailable() -> str | None:
        """Why a shaped link cannot be made here (None when it can)."""
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            return "shaping the link needs root (network namespaces and tc)"
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            return f"shaping the link needs iproute2 ({', '.join(missing)} not found; apt-get install iproute2)"
        return None

    def _run(self, *cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")

    def __enter__(self) -> ShapedLink:
        self._run("ip", "netns", "add", self.name)
        try:
            ns = ("ip", "netns", "exec", self.name)
            self._run(*ns, "ip", "link", "set", "lo", "up")
            rate = f"{int(self.rate_bits)}bit"
            # tbf needs a bucket of at least one MTU (64 KiB on loopback) and about rate/HZ.
            burst = max(256 * 1024, int(self.rate_bits / 8 / 250))
            tbf = ("tbf", "rate", rate, "burst", str(burst), "latency", "50ms")
            if self.delay_s > 0:
                delay = f"{self.delay_s * 1e6:.0f}us"
                try:
                    self._run(*ns, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem", "delay", delay)
                except RuntimeError as err:
                    raise RuntimeError(
                        f"--latency needs the kernel's netem queueing discipline (module sch_netem), which this "
                        f"machine does not offer ({err}); run with --latency 0"
                    ) from err
                self._run(*ns, "tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:", *tbf)
            else:
                self._run(*ns, "tc", "qdisc", "add", "dev", "lo", "root", *tbf)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]


def describe_link(rate_bits: float | None, delay_s: float) -> str:
    if rate_bits is None:
        return "unshaped loopback"
    rate = f"{rate_bits / 1e9:g} Gbit/s" if rate_bits >= 1e9 else f"{rate_bits / 1e6:g} Mbit/s"
    return f"{rate} loopback (tc tbf in a network namespace)" + (f", +{delay_s * 1e3:g} ms delay" if delay_s else "")


# --------------------------------------------------------------------------- the parent
def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args)
    rate = parse_rate(args.bandwidth)
    delay = parse_latency(args.latency)
    parse_params(args.params)
    for name in ("world_size", "steps", "layers", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is not allowed: expected >= 1")
    if args.warmup < 2:
        raise ValueError(
            f"--warmup={args.warmup} is not allowed: expected >= 2 (DDP rebuilds its buckets after step 1)"
        )
    if not 0 < args.density <= 1:
        raise ValueError(f"--density={args.density} is not allowed: expected a number in (0, 1]")
    if args.fallback == "time":
        # the timed steps come after the trial (warm-up step, trial, the step that decides)
        from lightning_sparse.fallback import TimedFallback

        args.warmup = max(args.warmup, TimedFallback().trial_length + 2)
    link: ShapedLink | None = None
    if rate is not None or delay > 0:
        why = ShapedLink.unavailable()
        if why:
            print(f"step: {why}; running on the unshaped loopback instead.", file=sys.stderr)
            rate, delay = None, 0.0
        else:
            link = ShapedLink(rate or 1e12, delay)
    peers = list(dict.fromkeys(Peer.parse(spec).name for spec in args.peers))  # raises on a bad name
    if args.probe_timeout <= 0:
        raise ValueError(f"--probe-timeout={args.probe_timeout} is not allowed: expected a number of seconds > 0")
    wrap: Callable[[list[str]], list[str]] = (lambda cmd: cmd) if link is None else link.wrap
    with tempfile.TemporaryDirectory() as tmp, link if link is not None else contextlib.nullcontext():

        def launch(tag: str, extra: list[str], **kwargs: Any) -> str | None:
            return _launch(args, Path(tmp) / tag, wrap, free_port(), extra, **kwargs)

        failed: dict[str, str] = {}
        for name in peers:
            print(f"step: probing peer {name} ...", file=sys.stderr)
            probe = ["--probe", "--no-dense", "--peers", name, "--warmup", str(args.warmup), "--steps", "2"]
            why = launch(f"probe-{name}", probe, timeout=args.probe_timeout)
            if why is not None:
                print(f"step: peer {name} failed its probe ({why}); it is left out of the timed run.", file=sys.stderr)
                failed[name] = why
        ok = [name for name in peers if name not in failed]
        result_path = Path(tmp) / "result.json"
        why = launch("run", ["--peers", *ok], result_path=result_path, echo=True)
        if why is not None:
            # Once more, without the peers if there were any (a peer can crash the run even after a
            # clean probe). A failure that repeats is raised below; one that does not is printed here.
            print(
                f"step: the timed run failed ({why}); running it again{' without the peers' if ok else ''}.",
                file=sys.stderr,
            )
            failed.update({name: f"crashed the timed run: {why}" for name in ok})
            why = launch("rerun", ["--peers"], result_path=result_path, echo=True)
        if why is not None:
            raise RuntimeError(f"the benchmark ranks failed: {why}")
        result = json.loads(result_path.read_text())
    result["runs"] += [failed_row(Peer.parse(name).label, failed[name]) for name in peers if name in failed]
    result["peers"] = peers
    result["link"] = describe_link(rate, delay)
    result["bandwidth_bits"] = rate
    result["latency_s"] = delay
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _launch(
    args: argparse.Namespace,
    logs: Path,
    wrap: Callable[[list[str]], list[str]],
    port: int,
    extra: list[str],
    *,
    timeout: float | None = None,
    result_path: Path | None = None,
    echo: bool = False,
) -> str | None:
    """Run the ranks (``extra``: worker arguments after the forwarded ones, which they override).

    Each rank's output goes to a file under ``logs``, replayed to stderr with ``echo`` (its tail
    when the ranks fail). Returns None when every rank exited cleanly, else a short reason (see
    :func:`failure_reason`; on a timeout, with the exception of a rank that died before it). Ranks
    still running at the timeout are killed.
    """
    base = [sys.executable, "-m", "lightning_sparse.bench", "step", "--worker", "--port", str(port)]
    forwarded = [
        "--world-size", str(args.world_size), "--params", str(args.params), "--layers", str(args.layers),
        "--batch-size", str(args.batch_size), "--density", str(args.density), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--fallback", args.fallback, "--compressors", *args.compressors,
        "--modes", *args.modes, "--exchanges", *args.exchanges,
    ]  # fmt: skip
    if args.threads is not None:
        forwarded += ["--threads", str(args.threads)]
    if args.no_dense:
        forwarded.append("--no-dense")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logs.mkdir(parents=True, exist_ok=True)
    cmds, paths = [], []
    for rank in range(args.world_size):
        cmd = [*base, "--rank", str(rank), *forwarded, *extra]
        if rank == 0 and result_path is not None:
            cmd += ["--result", str(result_path)]
        cmds.append(wrap(cmd))
        paths.append(logs / f"rank{rank}.log")
    limit = args.timeout if timeout is None else min(timeout, args.timeout)
    codes, timed_out = run_ranks(cmds, env, paths, limit)
    outputs = [path.read_text(errors="replace") for path in paths]
    ok = not timed_out and all(code == 0 for code in codes)
    for rank, text in enumerate(outputs):
        if text.strip() and (echo or not ok):
            sys.stderr.write(f"--- rank {rank} ({logs.name}) ---\n{text[-20000 if echo else -3000 :]}")
    if ok:
        return None
    # a rank killed here (a hang) has a negative code; one that died on its own says why
    crashed = [text for text, code in zip(outputs, codes, strict=True) if code not in (0, -signal.SIGKILL)]
    if timed_out:
        why = f"timed out after {limit:g} s"
        return f"{failure_reason(crashed, codes)}; the others then {why}" if crashed else why
    return failure_reason([text for text, code in zip(outputs, codes, strict=True) if code != 0], codes)


#: what a rank reports when another rank died under it: not the cause
_KNOCK_ON = re.compile(r"connection (closed|reset)|broken pipe|peer|timed out|socket", re.IGNORECASE)
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]: ?)?(?:[\w.]+\.)?(\w+(?:Error|Exception)): ?(.*)$")


def failure_reason(outputs: list[str], codes: list[int], limit: int = 120) -> str:
    """A short reason from the output of the failed ranks: the last exception line of each rank (a
    rank's own failure before a knock-on one of a rank that lost its peer), else the last line."""
    reasons = []
    for text in outputs:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        found = next((m for m in map(_EXCEPTION.match, reversed(lines)) if m), None)
        if found is not None:
            message = found.group(2).splitlines()[0] if found.group(2) else ""
            reasons.append(f"{found.group(1)}: {message}" if message else found.group(1))
        elif lines:
            reasons.append(lines[-1])
    if not reasons:
        return f"exit codes {codes}"
    reason = next((r for r in reasons if not _KNOCK_ON.search(r)), reasons[0])
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def failed_row(name: str, status: str) -> dict[str, Any]:
    """The table row of a run that could not be timed."""
    return {
        "name": name,
        "status": f"failed: {status}",
        "median_s": None,
        "times_s": [],
        "bytes_per_step": None,
        "compression_ratio": None,
        "hook_ms": None,
        "buckets": None,
        "dense_buckets": None,
        "wire_bytes_per_step": None,
    }


def format_table(result: dict[str, Any]) -> str:
    """The figures as a markdown table, with a header line saying what was measured."""
    lines = [
        f"step time: {result['world_size']} ranks on {result['link']}; MLP {result['layers']} x "
        f"{result['width']}^2 = {result['params'] / 1e6:.1f}M parameters, batch {result['batch_size']} per rank, "
        f"{result['threads']} torch thread(s) per rank; density {result['density']:g}; "
        f"fallback_to_dense {FALLBACKS[result.get('fallback', 'bytes')]!r}; median of {result['steps']} "
        f"steps after {result['warmup']} untimed; torch {result['torch']}",
        "",
        "| run | median step s | dense / run | MB sent per rank per step | MB on the wire per rank per step "
        "| compression ratio | hook ms per step | buckets sent dense | status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    dense = next((r["median_s"] for r in result["runs"] if r["name"] == DENSE), None)
    for r in result["runs"]:
        status = r.get("status", "ok")
        if r["median_s"] is None:  # a run that could not be timed (a peer that failed its probe)
            lines.append(f"| {r['name']} | - | - | - | - | - | - | - | {status} |")
            continue
        ratio = f"{dense / r['median_s']:.2f}x" if dense else "-"
        hook = "-" if r["hook_ms"] is None else f"{r['hook_ms']:.1f}"
        comp = "-" if r["compression_ratio"] is None else f"{r['compression_ratio']:.1f}x"
        fallback = "-" if r["dense_buckets"] is None else f"{r['dense_buckets']}/{r['buckets']}"
        wire = r.get("wire_bytes_per_step")  # absent in figures saved before it was measured
        wire_mb = "-" if wire is None else f"{wire / 1e6:.2f}"
        lines.append(
            f"| {r['name']} | {r['median_s']:.3f} | {ratio} | {r['bytes_per_step'] / 1e6:.2f} | {wire_mb} | {comp} "
            f"| {hook} | {fallback} | {status} |"
        )
    timed = [(r["name"], r["timed_fallback"][-1]) for r in result["runs"] if r.get("timed_fallback")]
    if timed:
        lines += ["", "timed fallback (median exchange window of the trial steps, slowest rank):"]
        lines += [
            f"- {name}: sparse {1e3 * d['sparse_s']:.1f} ms, dense {1e3 * d['dense_s']:.1f} ms -> {d['choice']}"
            for name, d in timed
        ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- one rank
def model_shape(params: int, layers: int) -> int:
    """Width of ``layers`` square Linear layers holding about ``params`` parameters."""
    return max(8, round(math.sqrt(params / layers)))


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lightning_sparse import SparseDDPStrategy, sparse_comm_hook
    from lightning_sparse.bench.compressors import parse_compressor
    from lightning_sparse.hook import local_gradient_hook

    world = args.world_size
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=args.rank, world_size=world)
    params = parse_params(args.params)
    width = model_shape(params, args.layers)

    def make_model() -> nn.Module:
        torch.manual_seed(0)  # same initial weights in every run and on every rank
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*layers[:-1])

    runs: list[tuple[str, DistributedDataParallel, Any]] = []
    exchanges: list[Any] = []  # per run: its UpdateExchange (update mode), else None
    if not args.no_dense:
        runs.append((DENSE, DistributedDataParallel(make_model()), None))
        exchanges.append(None)
    gather_exchanges: list[Exchange] = args.exchanges  # top-k-type compressors: each one asked for
    other_exchanges: list[Exchange] = ["auto"]
    for mode in [] if args.probe else args.modes:
        for spec, how in [
            (name, how)
            for name in args.compressors
            for how in (gather_exchanges if parse_compressor(name).pattern == "gather" else other_exchanges)
        ]:
            # The strategy's own defaults (min_numel, warm-up, dense fallback, DDP arguments);
            # registered as SparseDDPStrategy._register_ddp_hooks does it.
            fallback = FALLBACKS[args.fallback]
            strategy = SparseDDPStrategy(
                compress=mode,
                compressor=parse_compressor(spec),
                density=args.density,
                fallback_to_dense=fallback,
                exchange=how,
            )
            model = DistributedDataParallel(make_model(), **strategy._ddp_kwargs)
            state = strategy.sparse_state
            exchange = strategy.update_exchange
            if exchange is not None:
                exchange.bind(model.module.named_parameters(), process_group=model.process_group)
                model.register_comm_hook(None, local_gradient_hook)
            else:
                state.bind(model.module.named_parameters(), process_group=model.process_group)
                model.register_comm_hook(state, sparse_comm_hook)
            runs.append((f"sparse_ddp {spec} ({mode}{'' if how == 'auto' else ', ' + how})", model, state))
            exchanges.append(exchange)
    # torch's hooks: their bytes are counted at the torch.distributed collectives, while they step
    counter = CollectiveCounter()
    peer_bytes: dict[int, int] = {}  # run index -> bytes its timed steps handed to collectives
    for name in args.peers:
        peer = Peer.parse(name)
        model = DistributedDataParallel(make_model())
        model.register_comm_hook(*peer.registered_hook())
        peer_bytes[len(runs)] = 0
        runs.append((peer.label, model, None))
        exchanges.append(None)
    if peer_bytes:
        counter.install()
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for _, m, _ in runs]
    gen = torch.Generator().manual_seed(1 + args.rank)
    times: list[list[float]] = [[] for _ in runs]
    before: list[Any] = [None for _ in runs]
    for step in range(args.warmup + args.steps):
        if step == args.warmup:  # the figures of the timed steps only
            before = [None if state is None else state.telemetry.total.copy() for _, _, state in runs]
        x = torch.randn(args.batch_size, width, generator=gen)
        y = torch.randn(args.batch_size, width, generator=gen)
        for i, ((_, model, _), opt, exchange) in enumerate(zip(runs, optimizers, exchanges, strict=True)):
            counted = step >= args.warmup and i in peer_bytes
            dist.barrier()
            start = time.perf_counter()
            if counted:
                mark = counter.bytes
                counter.start()
            if exchange is not None:
                exchange.enter_local()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # DDP waits for every bucket's future (callbacks' collectives included)
            opt.step()
            if exchange is not None:
                exchange.exchange()
            opt.zero_grad(set_to_none=False)
            elapsed = time.perf_counter() - start
            if counted:
                counter.stop()
                peer_bytes[i] += counter.bytes - mark
            if step >= args.warmup:
                times[i].append(elapsed)
    counter.uninstall()
    # A step lasts as long as its slowest rank.
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    summaries = []
    for i, ((name, _, state), ts, snapshot) in enumerate(zip(runs, t.tolist(), before, strict=True)):
        counters = None if state is None else state.telemetry.total - snapshot
        summaries.append(_summary(name, counters, ts, args, width, peer_bytes.get(i)))
        if state is not None and state.timed_fallback is not None:
            summaries[-1]["timed_fallback"] = state.timed_fallback.decisions
    if args.rank == 0 and args.result:
        result = {
            "world_size": world,
            "params": args.layers * (width * width + width),
            "layers": args.layers,
            "width": width,
            "batch_size": args.batch_size,
            "threads": threads,
            "density": args.density,
            "steps": args.steps,
            "warmup": args.warmup,
            "fallback": args.fallback,
            "torch": torch.__version__,
            "runs": summaries,
        }
        with open(args.result, "w") as f:
            json.dump(result, f, indent=2)
    end_process_group(exit_code=0)  # on every rank together, then out: see its docstring
    return 0


def _summary(
    name: str, counters: Any, times: list[float], args: argparse.Namespace, width: int, counted: int | None = None
) -> dict[str, Any]:
    """One run's figures over its timed steps (``counters``: the hook's telemetry then, None for dense
    and the peers; ``counted``: the bytes a peer's hook handed to the collectives then)."""
    from lightning_sparse.wire import ring_all_reduce_bytes

    params = args.layers * (width * width + width)
    row: dict[str, Any] = {
        "name": name,
        "status": "ok",
        "median_s": statistics.median(times),
        "times_s": times,
        "bytes_per_step": float(params * 4),
        # through each rank under the ring model: dense DDP and torch's hooks all-reduce
        "wire_bytes_per_step": ring_all_reduce_bytes(args.world_size, params * 4),
        "compression_ratio": None,
        "hook_ms": None,
        "buckets": None,
        "dense_buckets": None,
    }
    if counters is not None:
        steps = len(times)
        row.update(
            bytes_per_step=counters.sent_bytes / steps,
            wire_bytes_per_step=counters.wire_bytes / steps,
            compression_ratio=counters.message_ratio,  # bytes per step are bytes sent: same basis as the peers'
            hook_ms=1e3 * counters.compress_seconds / steps,
            buckets=counters.buckets,
            dense_buckets=counters.dense_buckets,
        )
    if counted is not None:
        row["bytes_per_step"] = counted / len(times)
        row["wire_bytes_per_step"] = ring_all_reduce_bytes(args.world_size, row["bytes_per_step"])
        row["compression_ratio"] = params * 4 / row["bytes_per_step"] if counted else None
    return row
