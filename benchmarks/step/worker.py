"""One rank of a timed run: it builds every run's DDP model, steps them round-robin and reports the figures."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._json import write_json
from benchmarks.opcount import count_comm_calls
from benchmarks.peers import CollectiveCounter, Peer
from benchmarks.step.options import DENSE, FALLBACKS, Exchange, parse_params
from lightning_sparse import end_process_group


def model_shape(params: int, layers: int) -> int:
    """Width of ``layers`` square Linear layers holding about ``params`` parameters."""
    return max(8, round(math.sqrt(params / layers)))


def _step(model: Any, opt: Any, exchange: Any, x: Any, y: Any) -> None:
    """One optimizer step of a run (update mode: the rank's view, then the exchange)."""
    from torch import nn

    if exchange is not None:
        exchange.hold_local()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # DDP waits for every bucket's future (callbacks' collectives included)
    # a timed fallback's plain DDP step averages here (Replicas; at revisions before it DDP's hook did)
    gradients_ready = getattr(model, "gradients_ready", None)
    if exchange is not None and gradients_ready is not None:
        gradients_ready(exchange.state)
    opt.step()
    if exchange is not None:
        exchange.exchange()
    opt.zero_grad(set_to_none=False)


def _ddp(module: Any, **kwargs: Any) -> Any:
    """DDP without its initial broadcast (the models start equal), where this torch's DDP can skip it (2.5+)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs["init_sync"] = False
    return DistributedDataParallel(module, **kwargs)


def _update_model(module: Any, strategy: Any) -> Any:
    """Update mode's model, bound to the strategy's exchange, as the package at hand builds it:
    ``Replicas``, or DDP with ``update_comm_hook`` (which kept each rank's own gradient) at the
    revisions before it, such as ``bfb574b``: under ``--rev`` this worker runs the old package too."""
    try:
        from lightning_sparse.exchange.replicas import Replicas
    except ImportError:
        from lightning_sparse.exchange.hook import update_comm_hook  # removed with Replicas

        model = _ddp(module, **strategy._ddp_kwargs)
        strategy.update_exchange.bind(model.module.named_parameters(), process_group=model.process_group)
        model.register_comm_hook(strategy.sparse_state, update_comm_hook)
        return model
    model = Replicas(module, init_sync=False)  # no DDP: each rank keeps its own gradient
    strategy.update_exchange.bind(model.module.named_parameters(), process_group=model.process_group)
    return model


def _check_package(root: str) -> None:
    """Refuse to run (``RuntimeError``) unless the imported ``lightning_sparse`` lies under ``root``."""
    import lightning_sparse

    imported = Path(lightning_sparse.__file__).resolve()
    if Path(root).resolve() not in imported.parents:
        raise RuntimeError(f"imported lightning_sparse from {imported}, expected it under {root}")


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    from benchmarks.compressors import parse_compressor
    from lightning_sparse import SparseDDPStrategy, sparse_comm_hook

    if getattr(args, "package_root", None):
        _check_package(args.package_root)
    world = args.world_size
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=args.rank, world_size=world)
    params = parse_params(args.params)
    width = model_shape(params, args.layers)

    def make_model() -> nn.Module:
        # same initial weights in every run and on every rank: DDP's initial broadcast is skipped
        # (init_sync=False), which on a slow link would take minutes per model
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*layers[:-1])

    runs: list[tuple[str, nn.Module, Any]] = []
    exchanges: list[Any] = []  # per run: its UpdateExchange (update mode), else None
    if not args.no_dense:
        runs.append((DENSE, _ddp(make_model()), None))
        exchanges.append(None)
    gather_exchanges: list[Exchange] = args.exchanges  # top-k-type compressors: each one asked for
    other_exchanges: list[Exchange] = ["auto"]
    delayed: set[int] = set()  # runs whose exchanges travel while their next steps run
    for mode in [] if args.probe else args.modes:
        for spec, how, sync, delay, fragments in [
            (name, way, h, d, f)
            for name in args.compressors
            for way in (gather_exchanges if parse_compressor(name).pattern == "gather" else other_exchanges)
            for h in (getattr(args, "sync_every", None) or [1] if mode == "update" else [1])
            for d in (getattr(args, "sync_delay", None) or [0] if mode == "update" and h > 1 else [0])
            for f in (getattr(args, "fragments", None) or [1] if mode == "update" and h > 1 else [1])
            if d <= h
        ]:
            # The strategy's own defaults (min_numel, warm-up, dense fallback, DDP arguments);
            # registered as SparseDDPStrategy._register_ddp_hooks does it.
            fallback = FALLBACKS[args.fallback]
            extra_args: dict[str, Any] = {}
            if getattr(args, "value_bits", None) is not None and parse_compressor(spec).pattern == "gather":
                extra_args["value_bits"] = args.value_bits
            if getattr(args, "warmup_exchanges", None) is not None:
                extra_args["warmup_steps"] = args.warmup_exchanges
            strategy = SparseDDPStrategy(
                compress=mode,
                compressor=parse_compressor(spec),
                density=args.density,
                fallback_to_dense=fallback,
                exchange=how,
                sync_every=sync,
                sync_delay=delay,
                fragments=fragments,
                **extra_args,
            )
            state = strategy.sparse_state
            exchange = strategy.update_exchange
            if exchange is not None:
                model = _update_model(make_model(), strategy)
            else:
                model = _ddp(make_model(), **strategy._ddp_kwargs)
                state.bind(model.module.named_parameters(), process_group=model.process_group)
                model.register_comm_hook(state, sparse_comm_hook)
            extra = ("" if how == "auto" else ", " + how) + ("" if sync == 1 else f", every {sync} steps")
            if "value_bits" in extra_args:
                extra += f", {args.value_bits}-bit values"
            if fragments > 1:
                extra += f", {fragments} fragments"
            if delay:
                extra += f", delay {delay}"
                delayed.add(len(runs))
            runs.append((f"sparse_ddp {spec} ({mode}{extra})", model, state))
            exchanges.append(exchange)
    # torch's hooks: their bytes are counted at the torch.distributed collectives, while they step
    counter = CollectiveCounter()
    peer_bytes: dict[int, int] = {}  # run index -> bytes its timed steps handed to collectives
    for name in args.peers:
        peer = Peer.parse(name)
        model = _ddp(make_model())
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
    # the package's collectives (lightning_sparse.wire.comm's calls) of each run's timed steps
    collectives = [0 for _ in runs]
    comm_calls = count_comm_calls()
    calls = comm_calls.__enter__()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:  # the figures of the timed steps only
            before = [None if state is None else state.telemetry.total.copy() for _, _, state in runs]
        x = torch.randn(args.batch_size, width, generator=gen)
        y = torch.randn(args.batch_size, width, generator=gen)
        for i, ((_, model, _), opt, exchange) in enumerate(zip(runs, optimizers, exchanges, strict=True)):
            if i in delayed:
                continue  # in a block of its own, below
            counted = step >= args.warmup and i in peer_bytes
            dist.barrier()
            start = time.perf_counter()
            if counted:
                mark = counter.bytes
                counter.start()
            issued = sum(calls.values())
            _step(model, opt, exchange, x, y)
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                collectives[i] += sum(calls.values()) - issued
            if counted:
                counter.stop()
                peer_bytes[i] += counter.bytes - mark
            if step >= args.warmup:
                times[i].append(elapsed)
    # A run whose exchanges are in flight while it steps on: its steps in a block, with no barrier
    # between them (a barrier on the process group would wait for the exchange in flight); each step
    # timed on its own, the block's collectives finished afterwards, untimed.
    for i in sorted(delayed):
        (_, model, state), opt, exchange = runs[i], optimizers[i], exchanges[i]
        gen_block = torch.Generator().manual_seed(1 + args.rank)
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                before[i] = state.telemetry.total.copy()
                dist.barrier()
            x = torch.randn(args.batch_size, width, generator=gen_block)
            y = torch.randn(args.batch_size, width, generator=gen_block)
            start = time.perf_counter()
            issued = sum(calls.values())
            _step(model, opt, exchange, x, y)
            if step >= args.warmup:
                times[i].append(time.perf_counter() - start)
                collectives[i] += sum(calls.values()) - issued
        exchange.hold_global()  # what is still in flight arrives
        dist.barrier()
    counter.uninstall()
    comm_calls.__exit__(None, None, None)
    # A step lasts as long as its slowest rank.
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    summaries = []
    for i, ((name, _, state), ts, snapshot) in enumerate(zip(runs, t.tolist(), before, strict=True)):
        counters = None if state is None else state.telemetry.total - snapshot
        summaries.append(_summary(name, counters, ts, args, width, peer_bytes.get(i)))
        if state is not None:
            # the exchanges' own: dense DDP's and torch's hooks' collectives do not go through the package
            summaries[-1]["collectives"] = collectives[i]
            summaries[-1]["collectives_per_step"] = collectives[i] / max(1, args.steps)
            telemetry = state.telemetry
            summaries[-1]["peak_step_wire_bytes"] = telemetry.peak_step_wire_bytes
            summaries[-1]["wait_s_per_step"] = telemetry.wait_seconds / max(1, args.warmup + args.steps)
        # the rank's own timed fallback (older versions kept the live one in the config)
        timed = None if state is None else getattr(state, "timed_fallback", state.config.timed_fallback)
        if timed is not None:
            summaries[-1]["timed_fallback"] = timed.decisions
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
        write_json(args.result, result)
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
        # with local steps most steps exchange nothing: the mean over whole cycles is the step's cost
        "mean_s": statistics.fmean(times),
        "times_s": times,
        "bytes_per_step": float(params * 4),
        # through each rank under the ring model: dense DDP and torch's hooks all-reduce
        "wire_bytes_per_step": ring_all_reduce_bytes(args.world_size, params * 4),
        "compression_ratio": None,
        "hook_ms": None,
        "buckets": None,
        "dense_buckets": None,
        "collectives": None,
        "collectives_per_step": None,
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
