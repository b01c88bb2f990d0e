"""Low-bit values (``value_bits``): a bfloat16 scale per chunk of 64 values and a signed code per value.

A chunk's scale ``m`` is its largest magnitude; a value ``v`` travels as ``c = round(v / (m / L))`` in
``[-L, L]`` (``L = 2**(bits-1) - 1``; 2 bits is ternary, as in TernGrad) and stands for ``c * (m / L)``.
The grid holds zero and is uniform, so ``v - dequantized`` is exact in float32 (Sterbenz) and a rank
that keeps it in its residual conserves ``sent + e_new == e_old + delta`` bit for bit. A non-finite
value makes its whole chunk arrive non-finite on every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.wire.stats import ring_all_gather_bytes, ring_all_reduce_bytes

#: values share a scale in chunks of this many (in message order)
CHUNK = 64
#: the widths ``value_bits`` may take
VALUE_BITS = (2, 4, 8)


def levels(bits: int) -> int:
    """The largest code: codes run from ``-L`` to ``L`` (2 bits: -1, 0, 1)."""
    return (1 << (bits - 1)) - 1


def code_bytes(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits, packed."""
    return (count * bits + 7) // 8


def scale_bytes(count: int) -> int:
    """Bytes of the bfloat16 scales of ``count`` values."""
    return 2 * ((count + CHUNK - 1) // CHUNK)


def quantize(values: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """``(codes as int8, scales as bfloat16)`` of float values, chunk by chunk."""
    codes, scales = quantize_rows(values.reshape(1, -1), bits)
    return codes[0], scales[0]


def quantize_rows(values: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """:func:`quantize` of every row of ``values`` (``(rows, n)``, each chunked on its own), in a fixed
    number of operators: ``(codes (rows, n) int8, scales (rows, chunks) bfloat16)``."""
    rows, n = values.shape
    chunks = (n + CHUNK - 1) // CHUNK
    padded = torch.zeros(rows, chunks * CHUNK, dtype=torch.float32, device=values.device)
    padded[:, :n] = values
    chunked = padded.view(rows * chunks, CHUNK)
    scales = chunked.abs().amax(dim=1).to(torch.bfloat16)  # NaN and inf stay: the chunk arrives non-finite
    top = levels(bits)
    step = scales.float() / top
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round(chunked / safe[:, None]).nan_to_num_(0.0).clamp_(-top, top)
    codes = torch.where(step[:, None] > 0, codes, torch.zeros_like(codes))  # a zero scale: all zeros
    return codes.view(rows, chunks * CHUNK)[:, :n].to(torch.int8), scales.view(rows, chunks)


def dequantize(codes: Tensor, scales: Tensor, bits: int) -> Tensor:
    """The float32 values ``codes`` and ``scales`` stand for (the same on every rank; 2-D: a message a row).

    Example:
        >>> import torch
        >>> v = torch.tensor([0.6, -0.9, 0.01, 1.0])
        >>> codes, scales = quantize(v, bits=2)
        >>> d = dequantize(codes, scales, bits=2)
        >>> d.tolist(), torch.equal(d + (v - d), v)
        ([1.0, -1.0, 0.0, 1.0], True)
    """
    step = scales.float() / levels(bits)
    return codes.float() * step.repeat_interleave(CHUNK, dim=-1)[..., : codes.shape[-1]]


def remainder(exact: Tensor, sent: Tensor) -> Tensor:
    """What stays in the residual after ``exact`` travelled as codes standing for ``sent``: ``exact - sent``
    (exact in float32), or all of ``exact`` where ``sent`` is not finite (every rank skips that step).

    Example:
        >>> import torch
        >>> remainder(torch.tensor([0.75, 0.75]), torch.tensor([1.0, float("nan")])).tolist()
        [-0.25, 0.75]
    """
    return torch.where(torch.isfinite(sent), exact - sent, exact)


def message_bytes(count: int, bits: int) -> int:
    """Bytes of :func:`pack`'s message of ``count`` values: the scales, then the codes, to 8 bytes."""
    return -(-(scale_bytes(count) + code_bytes(count, bits)) // 8) * 8


def pack(values: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """``(message, stands_for)``: ``values`` as one uint8 message of :func:`message_bytes` (their
    scales, then their packed codes), and the float32 values the message stands for.

    Example:
        >>> import torch
        >>> message, d = pack(torch.tensor([0.6, -0.9, 0.01, 1.0]), bits=2)
        >>> message.numel(), torch.equal(unpack_rows(message[None], 4, bits=2)[0], d)
        (8, True)
    """
    n = values.numel()
    codes, scales = quantize(values, bits)
    message = torch.zeros(message_bytes(n, bits), dtype=torch.uint8, device=values.device)
    at = scale_bytes(n)
    message[:at].view(torch.bfloat16).copy_(scales)
    pack_codes(codes, bits, message[at : at + code_bytes(n, bits)])
    return message, dequantize(codes, scales, bits)


def unpack_rows(messages: Tensor, count: int, bits: int) -> Tensor:
    """The float32 values of :func:`pack` messages of ``count`` values, a message a row: ``(rows, count)``."""
    at = scale_bytes(count)
    codes = unpack_codes(messages[:, at : at + code_bytes(count, bits)], count, bits)
    return dequantize(codes, messages[:, :at].view(torch.bfloat16), bits)


def pack_codes(codes: Tensor, bits: int, out: Tensor) -> None:
    """Write int8 codes (in ``[-L, L]``) into ``out`` (uint8, :func:`code_bytes` long), ``8 // bits`` per byte."""
    pack_code_rows(codes[None], None, bits, out[None])


def pack_code_rows(codes: Tensor, valid: Tensor | None, bits: int, out: Tensor) -> None:
    """:func:`pack_codes` of every row of ``codes`` (``(rows, n)``) into ``out`` (``(rows, code_bytes(n))``),
    only where ``valid``: byte for byte what :func:`pack_codes` of each row's valid codes writes."""
    per = 8 // bits
    rows, n = codes.shape
    u = (codes.to(torch.int16) + levels(bits)).to(torch.uint8)  # offset to [0, 2L]
    padded = torch.zeros(rows, code_bytes(n, bits) * per, dtype=torch.uint8, device=codes.device)
    padded[:, :n] = u if valid is None else torch.where(valid, u, 0)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    # the codes of a byte occupy disjoint bits, so their sum is their bitwise or
    out.copy_(torch.sum(padded.view(rows, -1, per) << shifts, dim=2, dtype=torch.uint8))


def unpack_codes(data: Tensor, count: int, bits: int) -> Tensor:
    """The int8 codes :func:`pack_codes` wrote (``data`` 2-D: one message per row, ``count`` a row)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=data.device)
    u = (data.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # every code of a byte at once
    u = u.reshape(*data.shape[:-1], -1)[..., :count]
    return (u.to(torch.int16) - levels(bits)).to(torch.int8)


def coded_members_pay(world: int, numel: int, bits: int, value_bytes: int = 4) -> bool:
    """Whether ``numel`` small-tensor values move fewer ring-model bytes through each rank all-gathered
    as ``bits``-bit codes than all-reduced as they are (the same answer on every rank).

    Example:
        >>> coded_members_pay(2, 9728, 2), coded_members_pay(16, 9728, 8)
        (True, False)
    """
    coded = ring_all_gather_bytes(world, message_bytes(numel, bits))
    return coded < ring_all_reduce_bytes(world, numel * value_bytes)
