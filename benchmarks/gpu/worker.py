"""One process of one run: a Fabric loop on a GPT, its timed steps, and (rank 0) a profile of a few more."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.gpu.options import MODELS, RUNS, Run
from benchmarks.opcount import count_comm_calls

#: the CUDA runtime and driver calls that launch a kernel
KERNEL_LAUNCHES = frozenset(
    {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel"}
)
#: the calls that make the host wait for the device
HOST_SYNCS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})
#: profiler events of a collective: the dispatcher's c10d operators (one per collective, DDP's
#: reducer's included) and the backends' own (``gloo:all_reduce``, ``nccl:all_reduce``, ...)
_COLLECTIVE_PREFIXES = ("c10d::", "gloo:", "nccl:")


def build_model(model: str) -> Any:
    """The run's GPT (``lightning_sparse.demos.gpt.TinyGPT`` in the shape ``MODELS[model]``)."""
    import torch

    from lightning_sparse.demos.gpt import TinyGPT

    shape = MODELS[model]
    torch.manual_seed(0)  # the same initial weights in every process
    return TinyGPT(
        vocab=shape["vocab"],
        context=shape["context"],
        width=shape["width"],
        layers=shape["layers"],
        heads=shape["heads"],
    )


def profile_counts(events: Any, steps: int, cuda: bool) -> dict[str, Any]:
    """Per-step counts of a profile's events (``prof.events()``): host synchronisations, scalar reads,
    kernel launches (None without CUDA: there are none to count), operators and collectives.

    Example:
        >>> from types import SimpleNamespace as E
        >>> counts = profile_counts([E(name="cudaLaunchKernel")] * 4 + [E(name="aten::nonzero")], 2, cuda=True)
        >>> counts["kernel_launches"], counts["nonzero"], counts["host_syncs"]
        (2.0, 0.5, 0.0)
    """
    names: Counter[str] = Counter(e.name for e in events)
    per = 1.0 / max(1, steps)
    collectives = {name: per * n for name, n in sorted(names.items()) if name.startswith(_COLLECTIVE_PREFIXES)}
    return {
        "host_syncs": per * sum(names[n] for n in HOST_SYNCS) if cuda else None,
        "host_syncs_by_call": {n: per * names[n] for n in sorted(HOST_SYNCS) if names[n]},
        "scalar_reads": per * names["aten::_local_scalar_dense"],
        "nonzero": per * names["aten::nonzero"],
        "kernel_launches": per * sum(names[n] for n in KERNEL_LAUNCHES) if cuda else None,
        "aten_ops": per * sum(n for name, n in names.items() if name.startswith("aten::")),
        "collectives": per * sum(n for name, n in names.items() if name.startswith("c10d::")),
        "collective_events": collectives,
    }


def top_ops(prof: Any, steps: int, limit: int = 40) -> list[dict[str, Any]]:
    """The profile's operators with the most self host time: name, calls, host and device
    microseconds per step."""
    per = 1.0 / max(1, steps)
    rows = []
    for avg in prof.key_averages():
        device_us = getattr(avg, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(avg, "self_cuda_time_total", 0.0)
        rows.append(
            {
                "name": avg.key,
                "calls": per * avg.count,
                "self_cpu_us": per * avg.self_cpu_time_total,
                "self_device_us": per * float(device_us or 0.0),
            }
        )
    rows.sort(key=lambda r: -r["self_cpu_us"])
    return rows[:limit]


def label_exchange(strategy: Any) -> None:
    """Name the update exchange's parts in the profile: the whole exchange after an optimizer step,
    the waits for an average, and the arrival of delayed exchanges."""
    import functools

    import torch

    update = strategy._core.update
    for attr in ("exchange", "_wait", "land_due" if hasattr(update, "land_due") else "_complete"):
        original = getattr(update, attr)

        @functools.wraps(original)
        def labelled(*a: Any, _original: Any = original, _label: str = f"lightning_sparse.{attr}", **k: Any) -> Any:
            with torch.profiler.record_function(_label):
                return _original(*a, **k)

        setattr(update, attr, labelled)


#: ``record_function`` ranges (torch's, Lightning's and :func:`label_exchange`'s), left out of the
#: device's busy time: the profiler gives a range the device time of the kernels inside it
_RANGES = ("lightning_sparse.", "DistributedDataParallel.", "Optimizer.", "ProfilerStep")


def timeline(prof: Any, steps: int) -> dict[str, Any]:
    """Per step: the host time inside each labelled part of the exchange (:func:`label_exchange`),
    and the device's busy time (its kernels' and copies' durations summed)."""
    per = 1.0 / max(1, steps)
    ranges: Counter[str] = Counter()
    for event in prof.events():
        if event.name.startswith("lightning_sparse."):
            ranges[event.name] += event.cpu_time_total
    busy = 0.0
    for avg in prof.key_averages():
        if avg.key.startswith(_RANGES):
            continue  # a labelled range: its device time is its kernels', counted by themselves
        device_us = getattr(avg, "self_device_time_total", None)
        busy += float(device_us if device_us is not None else getattr(avg, "self_cuda_time_total", 0.0))
    return {"host_us_in": {k: per * v for k, v in ranges.items()}, "device_busy_us": per * busy}


def write_trace(prof: Any, path: Path) -> None:
    """The profile as a gzipped Chrome trace (chrome://tracing, Perfetto)."""
    import gzip
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        path.write_bytes(gzip.compress(raw.read_bytes()))


def sync_sites(steps: Any) -> Counter[str]:
    """Run ``steps()`` under ``torch.cuda.set_sync_debug_mode("warn")`` and count each synchronising
    call by its innermost frames (three at most) in ``lightning_sparse``, else its innermost frame."""
    import traceback
    import warnings

    import torch

    sites: Counter[str] = Counter()

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        ours = [f for f in frames if "lightning_sparse" in f.filename]
        chosen = ours[-3:] if ours else frames[-1:]
        sites[" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(chosen))] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            steps()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def worker(args: argparse.Namespace) -> int:
    """Run the rows ``args.runs`` in turn as process ``args.rank`` of ``args.world_size``; write
    their figures to ``args.out/rank{R}.json`` (row -> figures)."""
    import torch
    import torch.distributed as dist

    from lightning_sparse import end_process_group

    cuda = args.accelerator == "cuda"
    world, rank = args.world_size, args.rank
    if not cuda:
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    own_gpus = cuda and torch.cuda.device_count() >= world  # one GPU per process (NCCL), else shared (gloo)
    device = torch.device("cuda", rank if own_gpus else 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if own_gpus else "gloo"
    # what Fabric's strategies read: the processes are started outside Fabric, one group for every row
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
    )
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    figures: dict[str, Any] = {}
    for name in args.runs:
        figures[name] = run_row(args, name, device, backend, own_gpus)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(figures))
    end_process_group(exit_code=0)  # on every rank together, then out
    return 0


def run_row(args: argparse.Namespace, name: str, device: Any, backend: str, own_gpus: bool) -> dict[str, Any]:
    """One row on this process: warm-up, timed and profiled steps of a fresh model in a fresh Fabric."""
    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
    from torch import nn

    from lightning_sparse.fabric import SparseDDPStrategy

    run: Run = RUNS[name]
    cuda = device.type == "cuda"
    world, rank = args.world_size, args.rank
    precision = args.precision or ("bf16-mixed" if cuda else "32-true")
    strategy: Any
    if run.kind == "floor":
        strategy = SingleDeviceStrategy(device=device)  # no communication: the group only starts and ends the row
    else:
        devices = [torch.device("cuda", r if own_gpus else 0) if cuda else torch.device("cpu") for r in range(world)]
        if run.kind == "dense":
            strategy = DDPStrategy(parallel_devices=devices, process_group_backend=backend)
        else:
            strategy = SparseDDPStrategy(parallel_devices=devices, process_group_backend=backend, **run.settings)
    fabric = Fabric(strategy=strategy, precision=precision)
    fabric.launch()
    model = build_model(args.model)
    tensors = sum(1 for _ in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    shape = MODELS[args.model]
    batch = args.batch_size or shape["batch"]
    gen = torch.Generator(device=device).manual_seed(1 + rank)  # every process its own data
    batches = [
        torch.randint(shape["vocab"], (batch, shape["context"] + 1), device=device, generator=gen) for _ in range(4)
    ]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step(i: int) -> None:
        tokens = batches[i % len(batches)]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sparse = run.kind == "sparse"
    for i in range(args.warmup):
        step(i)
    sync()
    dist.barrier()
    exchanges_before = strategy.sparse_state.step if sparse else 0
    times: list[float] = []
    meet = run.settings.get("meet_every") if run.kind == "floor" else None
    with count_comm_calls() as calls:
        for i in range(args.warmup, args.warmup + args.steps):
            start = time.perf_counter()
            step(i)
            sync()
            if meet and (i + 1) % meet == 0:
                dist.barrier()  # the processes meet, as an exchange every `meet` steps makes them
            times.append(time.perf_counter() - start)
    exchanges = strategy.sparse_state.step - exchanges_before if sparse else 0
    dist.barrier()
    profile: dict[str, Any] | None = None
    if args.profile_steps > 0:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        first = args.warmup + args.steps
        if rank == 0:
            if sparse:
                label_exchange(strategy)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch_profile(activities=activities) as prof:
                for i in range(first, first + args.profile_steps):
                    step(i)
                sync()
            profile = profile_counts(prof.events(), args.profile_steps, cuda)
            profile["top_ops"] = top_ops(prof, args.profile_steps)
            profile.update(timeline(prof, args.profile_steps))
            if args.trace:
                write_trace(prof, Path(args.trace) / f"{name}.json.gz")
            if cuda:  # where the host waits: each synchronising call's stack in this package, per step
                sites = sync_sites(lambda: [step(i) for i in range(first, first + args.profile_steps)])
                profile["sync_sites"] = {k: v / args.profile_steps for k, v in sites.items()}
                sync()
        else:
            for i in range(first, first + args.profile_steps * (2 if cuda else 1)):
                step(i)
            sync()
    if sparse:
        strategy.global_model()  # an exchange still in flight (sync_delay) arrives before the next row
    dist.barrier()
    return {
        "rank": rank,
        "run": name,
        "device": str(device) if not cuda else f"{device} ({torch.cuda.get_device_name(device)})",
        "backend": None if run.kind == "floor" else backend,
        "precision": precision,
        "tensors": tensors,
        "params": params,
        "batch": batch,
        "context": shape["context"],
        "times_s": times,
        "mean_s": statistics.fmean(times),
        "median_s": statistics.median(times),
        "collectives": sum(calls.values()),
        "collectives_by_call": dict(calls),
        "exchanges": exchanges,
        "profile": profile,
    }
