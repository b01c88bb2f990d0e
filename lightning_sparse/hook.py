"""The DDP communication hook: bucket -> compress -> exchange -> decompress -> average.

DDP calls :func:`sparse_comm_hook` once per gradient bucket per optimizer step, on the autograd
thread, as soon as the bucket's gradients are ready. The hook compresses each parameter of the
bucket (its gradient plus error-feedback residual), packs the whole bucket into one message,
launches the collective asynchronously and returns a future; DDP overlaps that with the rest of
backward and waits for it before the optimizer step. The future's callback writes the averaged
dense gradient back into the bucket.

Compression is per parameter (each sparse parameter sends ``k = round(density * numel)``
coordinates, at least 1), so results do not depend on how DDP groups parameters into buckets;
communication is per bucket. Parameters below ``min_numel`` go dense, in the same step.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime
# (``bucket`` must be annotated with the class dist.GradBucket itself, not a string).

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_sparse import comm
from lightning_sparse.compressors import CompressContext
from lightning_sparse.state import BucketPlan, Member, SparseState
from lightning_sparse.stats import Counters

_INDEX_BYTES = 4  # indices travel as int32 (bucket offsets); buckets are far below 2**31 elements


def sparse_comm_hook(state: SparseState, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook (``ddp_model.register_comm_hook(state, sparse_comm_hook)``)."""
    return communicate(state, bucket.buffer(), bucket.parameters(), is_last=bucket.is_last())


def k_for(numel: int, density: float) -> int:
    """Number of coordinates sent for a tensor of ``numel`` elements at ``density`` (>= 1)."""
    return max(1, min(numel, round(density * numel)))


def communicate(state: SparseState, buffer: Tensor, params: list[Tensor], is_last: bool = True) -> Future[Tensor]:
    """Exchange one bucket: the body of the hook, callable on plain tensors (tests, benchmarks).

    ``buffer`` is the flat sum-ready local gradient of ``params`` (in their order); the returned
    future holds ``buffer`` overwritten with the average over ranks of what each rank sent.
    """
    start = time.perf_counter()
    plan = state.plan(buffer, params)
    counters = Counters(dense_bytes=buffer.numel() * buffer.element_size(), numel=buffer.numel(), buckets=1)
    sparse = plan.sparse_members
    exchange: Callable[..., Future[Tensor]] | None = None
    ks: list[int] = []
    if sparse and state.step >= state.warmup_steps:
        density = state.schedule.density(state.step)
        ks = [k_for(m.numel, density) for m in sparse]
        if state.fallback_to_dense and not _sparse_is_cheaper(state, buffer, sparse, ks):
            counters.fallback_buckets = 1
        else:
            exchange = _sparse_exchange
    if exchange is None:
        counters.dense_buckets = 1
        future = _dense_exchange(state, buffer, plan, counters)
    else:
        future = exchange(state, buffer, plan, ks, counters)
    counters.compress_seconds = time.perf_counter() - start
    state.telemetry.record(plan.label, counters)
    if is_last:
        _end_step(state)
    return future


def _end_step(state: SparseState) -> None:
    interval = state.residual_norm_interval
    if state.error_feedback and interval > 0 and state.step % interval == 0:
        state.telemetry.residual_norm = state.memory.norm_sq() ** 0.5
        state.telemetry.residual_norm_step = state.step
    state.telemetry.end_step()
    state.step += 1


def _value_dtype(state: SparseState, buffer: Tensor) -> torch.dtype:
    return state.value_dtype or buffer.dtype


def _sparse_is_cheaper(state: SparseState, buffer: Tensor, sparse: tuple[Member, ...], ks: list[int]) -> bool:
    """Ring-model wire bytes of the sparse exchange vs a dense all-reduce of the same tensors.

    A ring all-gather moves (W-1)*m bytes through each rank for an m-byte message; a ring
    all-reduce of n bytes moves 2*(W-1)/W*n. The dense parts of the bucket cost the same either
    way and are left out. World size 1 moves nothing either way: dense is then exact and free.
    """
    world = state.world_size
    if world <= 1:
        return False
    vbytes = torch.empty((), dtype=_value_dtype(state, buffer)).element_size()
    dense_wire = 2.0 * (world - 1) / world * sum(m.numel for m in sparse) * buffer.element_size()
    if state.compressor.pattern == "shared":
        sparse_wire = 2.0 * (world - 1) / world * sum(ks) * vbytes
    else:
        sparse_wire = (world - 1) * _gather_message_bytes(sum(ks), vbytes)
    return sparse_wire < dense_wire


def _gather_message_bytes(k: int, vbytes: int) -> int:
    raw = k * (_INDEX_BYTES + vbytes)
    return (raw + 7) // 8 * 8  # every rank's chunk starts 8-byte aligned so its views are valid


def _done(value: Tensor) -> Future[Tensor]:
    fut: Future[Tensor] = Future()
    fut.set_result(value)
    return fut


# --------------------------------------------------------------------------- dense
def _flush_residuals(state: SparseState, buffer: Tensor, members: tuple[Member, ...]) -> None:
    """Add any residual into the bucket before a dense send, so nothing stays behind unsent."""
    if not state.error_feedback:
        return
    for m in members:
        if m.name in state.memory:
            segment = buffer[m.offset : m.offset + m.numel]
            state.memory.accumulate(m.name, segment)
            sent = state.memory.flush(m.name, buffer.dtype)
            assert sent is not None
            segment.copy_(sent)


def _dense_exchange(state: SparseState, buffer: Tensor, plan: BucketPlan, counters: Counters) -> Future[Tensor]:
    _flush_residuals(state, buffer, plan.members)
    counters.sent_bytes += buffer.numel() * buffer.element_size()
    counters.sent_numel += buffer.numel()
    world = state.world_size
    if world == 1:
        return _done(buffer)
    return comm.all_reduce(buffer, state.process_group).then(lambda fut: fut.value()[0].div_(world))


# --------------------------------------------------------------------------- sparse
def _sparse_exchange(
    state: SparseState, buffer: Tensor, plan: BucketPlan, ks: list[int], counters: Counters
) -> Future[Tensor]:
    world = state.world_size
    vdtype = _value_dtype(state, buffer)
    compressor = state.compressor
    sparse = plan.sparse_members
    total_k = sum(ks)
    shared = compressor.pattern == "shared"

    if shared:
        message = torch.empty(total_k, dtype=vdtype, device=buffer.device)
        index_out = torch.empty(total_k, dtype=torch.long, device=buffer.device)
        values_out = message
    else:
        vbytes = torch.empty((), dtype=vdtype).element_size()
        nbytes = _gather_message_bytes(total_k, vbytes)
        message = torch.empty(nbytes, dtype=torch.uint8, device=buffer.device)
        index_out = message[: total_k * _INDEX_BYTES].view(torch.int32)
        values_out = message[total_k * _INDEX_BYTES : total_k * (_INDEX_BYTES + vbytes)].view(vdtype)
        message[total_k * (_INDEX_BYTES + vbytes) :].zero_()

    pos = 0
    for m, k in zip(sparse, ks, strict=True):
        g = buffer[m.offset : m.offset + m.numel]
        p = state.memory.accumulate(m.name, g) if state.error_feedback else g
        ctx = CompressContext(step=state.step, key=m.key, rank=state.rank, world_size=world, seed=state.seed)
        idx = compressor.select(p, k, ctx)
        if idx.numel() != k:
            raise RuntimeError(f"{type(compressor).__name__}.select returned {idx.numel()} indices for k={k}")
        values = p[idx]
        sent = values.to(vdtype)
        if state.error_feedback:
            remainder = None if sent.dtype == values.dtype else values - sent.to(values.dtype)
            state.memory.keep_unsent(m.name, idx, remainder)
        values_out[pos : pos + k].copy_(sent)
        index_out[pos : pos + k].copy_(idx)
        if m.offset:
            index_out[pos : pos + k].add_(m.offset)
        pos += k

    counters.sent_numel += total_k
    counters.sent_bytes += message.numel() * message.element_size()

    futures = []
    if shared:
        futures.append(comm.all_reduce(message, state.process_group))
    elif world > 1:
        gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=buffer.device)
        futures.append(comm.all_gather(gathered, message, state.process_group))
    else:
        gathered = message

    dense = plan.dense_members
    dense_values = None
    if dense:
        _flush_residuals(state, buffer, dense)
        dense_values = torch.cat([buffer[m.offset : m.offset + m.numel] for m in dense])
        counters.sent_bytes += dense_values.numel() * dense_values.element_size()
        counters.sent_numel += dense_values.numel()
        futures.append(comm.all_reduce(dense_values, state.process_group))

    def finish(_: Future[list[Future[list[Tensor]]]]) -> Tensor:
        for f in futures:
            f.value()  # re-raises a failed collective
        buffer.zero_()
        if shared:
            summed = message.to(buffer.dtype).div_(world)
            buffer.index_copy_(0, index_out, summed)
        else:
            chunk = message.numel()
            for r in range(world):
                part = gathered[r * chunk : (r + 1) * chunk]
                idx_r = part[: total_k * _INDEX_BYTES].view(torch.int32)
                val_r = part[total_k * _INDEX_BYTES : total_k * (_INDEX_BYTES + vbytes)].view(vdtype)
                # Each rank's indices are unique, so every add lands on its own coordinate and the
                # sum over ranks happens in rank order: identical bits on every rank, CUDA included.
                buffer.index_add_(0, idx_r, val_r.to(buffer.dtype), alpha=1.0 / world)
        if dense_values is not None:
            dense_values.div_(world)
            pos = 0
            for m in dense:
                buffer[m.offset : m.offset + m.numel].copy_(dense_values[pos : pos + m.numel])
                pos += m.numel
        return buffer

    if world == 1:
        return _done(finish(_done([])))  # type: ignore[arg-type]
    return torch.futures.collect_all(futures).then(finish)
