"""A bucket's sparse space, and the fixed-size messages of (value, coordinate) pairs that address it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.wire import quant
from lightning_sparse.wire.context import BucketPlan
from lightning_sparse.wire.indexcode import (
    decode_counted_rows,
    decode_index_rows,
    decode_indices,
    encode_index_rows,
    encode_indices,
    index_bytes,
    rice_capacity_bytes,
)

_INDEX_BYTES = 4  # uncoded indices travel as int32; buckets are far below 2**31 elements


def _align(nbytes: int, to: int) -> int:
    return (nbytes + to - 1) // to * to


def quantize(values: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast values for the wire; float16 saturates instead of overflowing to inf (the rest stays in the residual)."""
    if dtype == values.dtype:
        return values
    if dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        values = values.clamp(-limit, limit)
    return values.to(dtype)


@functools.lru_cache(maxsize=256)
def _space_tensors(space: SparseSpace, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """A space's member starts, shifts to bucket offsets and bounds on ``device``, made once (a host copy waits)."""
    shifts = [o - s for o, s in zip(space.offsets, space.starts, strict=True)]
    made = torch.tensor((*space.starts, space.numel, *shifts), dtype=torch.int64, device=device)
    n = len(space.starts)
    return made[:n], made[n + 1 :], made[: n + 1]


@dataclass(frozen=True)
class SparseSpace:
    """A bucket's sparse members laid end to end: the coordinates gather messages address.

    The tensors sent dense stay out of the index range (the compact code's size depends on it). The
    members are laid out by name, not in bucket order: DDP reorders a bucket when it rebuilds its
    buckets, and the split exchange's ownership of coordinates must not change with that.
    """

    numel: int
    members: tuple[int, ...]  # the sparse members (positions in ``plan.sparse_members``) in space order
    starts: tuple[int, ...]  # each one's first coordinate in this space (ascending)
    offsets: tuple[int, ...]  # and in the bucket

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def of(plan: BucketPlan) -> SparseSpace:
        sparse = plan.sparse_members
        order = sorted(range(len(sparse)), key=lambda i: sparse[i].name)
        starts, offsets, pos = [], [], 0
        for i in order:
            starts.append(pos)
            offsets.append(sparse[i].offset)
            pos += sparse[i].numel
        return SparseSpace(pos, tuple(order), tuple(starts), tuple(offsets))

    @functools.cached_property
    def _shift(self) -> int | None:
        """The one shift from coordinates to bucket offsets, if every member has the same."""
        shifts = {o - s for o, s in zip(self.offsets, self.starts, strict=True)}
        return shifts.pop() if len(shifts) == 1 else None

    def to_bucket(self, coords: Tensor) -> Tensor:
        """Bucket offsets of sparse-space coordinates (int64)."""
        shift = self._shift
        if shift is not None:
            return coords + shift if shift else coords
        starts, shifts_t, _ = _space_tensors(self, coords.device)
        member = torch.searchsorted(starts, coords, right=True) - 1
        return coords + shifts_t[member]

    def by_member(self, coords: Tensor) -> list[tuple[int, slice, Tensor]]:
        """``(position in space order, slice of coords, member-local indices)`` of each member that ascending
        ``coords`` reach."""
        bounds = _space_tensors(self, coords.device)[2]
        cuts = torch.searchsorted(coords, bounds).tolist()
        return [
            (i, slice(cuts[i], cuts[i + 1]), coords[cuts[i] : cuts[i + 1]] - self.starts[i])
            for i in range(len(self.starts))
            if cuts[i + 1] > cuts[i]
        ]


@dataclass(frozen=True)
class MessageLayout:
    """A fixed-size message of up to ``capacity`` (value, coordinate) pairs in ``[0, n)``.

    ``[count: int32, 4 bytes of padding (with header)][values][to 4 bytes][indices][to 8 bytes]``:
    values first so that their views are aligned; indices as int32 or, with ``compact``, Rice-coded
    (:mod:`lightning_sparse.wire.indexcode`) where smaller; with ``value_bits``, values as codes
    (:mod:`lightning_sparse.wire.quant`). The size depends only on the fields, so it is the same on
    every rank. Without a header the message holds exactly ``capacity`` pairs.

    Example:
        >>> import torch
        >>> layout = MessageLayout(n=10_000, capacity=100, value_dtype=torch.bfloat16, compact=True)
        >>> layout.coding, layout.size
        ('rice', 312)
        >>> coords = torch.arange(0, 10_000, 100)
        >>> got, values = layout.unpack(layout.pack(coords, torch.ones(100)))
        >>> torch.equal(got, coords), values.dtype
        (True, torch.bfloat16)
    """

    n: int
    capacity: int
    value_dtype: torch.dtype
    compact: bool
    header: bool = False
    value_bits: int | None = None

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def of(
        n: int, capacity: int, value_dtype: torch.dtype, compact: bool, header: bool = False, bits: int | None = None
    ) -> MessageLayout:
        """The layout of these fields, made once: its sizes are worked out at its first message only."""
        return MessageLayout(n, capacity, value_dtype, compact, header, bits)

    @functools.cached_property
    def coding(self) -> str:
        if self.compact and rice_capacity_bytes(self.n, self.capacity) < _INDEX_BYTES * self.capacity:
            return "rice"
        return "int32"

    @functools.cached_property
    def _values_at(self) -> int:
        return 8 if self.header else 0

    @functools.cached_property
    def _index(self) -> slice:
        if self.value_bits is None:
            value_bytes = self.capacity * self.value_dtype.itemsize
        else:
            value_bytes = quant.scale_bytes(self.capacity) + quant.code_bytes(self.capacity, self.value_bits)
        at = _align(self._values_at + value_bytes, 4)
        return slice(at, at + index_bytes(self.n, self.capacity, self.coding))

    @functools.cached_property
    def size(self) -> int:
        """Bytes per message (8-byte aligned, so every rank's part of a gathered buffer is too)."""
        return _align(self._index.stop, 8)

    def pack(self, coords: Tensor, values: Tensor, out: Tensor | None = None) -> Tensor:
        """Write sorted unique ``coords`` and their ``values`` into a zeroed uint8 message (``out``, or new)."""
        return self.pack_arriving(coords, values, out)[0]

    def pack_arriving(self, coords: Tensor, values: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`pack`, and the values as they arrive (what :meth:`unpack` gives back, without decoding)."""
        count = coords.numel()
        if count > self.capacity or (not self.header and count != self.capacity):
            raise ValueError(f"{count} pairs do not fit a message of capacity {self.capacity}")
        if out is None:
            out = torch.zeros(self.size, dtype=torch.uint8, device=coords.device)
        else:
            out.zero_()
        if self.header:
            out[:4].view(torch.int32).fill_(count)
        at = self._values_at
        bits = self.value_bits
        if bits is None:
            arriving = out[at : at + count * self.value_dtype.itemsize].view(self.value_dtype)
            arriving.copy_(values)
        else:
            codes, scales = quant.quantize(values, bits)
            out[at : at + 2 * scales.numel()].view(torch.bfloat16).copy_(scales)
            at += quant.scale_bytes(self.capacity)
            quant.pack_codes(codes, bits, out[at : at + quant.code_bytes(count, bits)])
            arriving = quant.dequantize(codes, scales, bits)
        index = out[..., self._index]
        if self.coding == "rice":
            encode_indices(coords, self.n, self.capacity, out=index)
        else:
            index[: count * _INDEX_BYTES].view(torch.int32).copy_(coords)
        return out, arriving

    def unpack(self, message: Tensor) -> tuple[Tensor, Tensor]:
        """``(int64 coordinates, values)`` of a message :meth:`pack` wrote: in ``value_dtype``, or
        float32 (what the codes stand for) with ``value_bits``."""
        count = int(message[:4].view(torch.int32)) if self.header else self.capacity
        values = self._read_values(message, count)
        index = message[..., self._index]
        if self.coding == "rice":
            return decode_indices(index, self.n, self.capacity, count), values
        return self._int32_coords(index, count), values

    def unpack_rows(self, messages: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`unpack` of every row of ``messages`` (``(rows, size)`` uint8, as an all-gather leaves
        them), in a fixed number of operators: each ``(rows, capacity)``. Messages without a header only.

        Example:
            >>> layout = MessageLayout(n=10_000, capacity=100, value_dtype=torch.float32, compact=True)
            >>> one = layout.pack(torch.arange(0, 10_000, 100), torch.ones(100))
            >>> coords, values = layout.unpack_rows(torch.stack([one, one]))
            >>> coords.shape, torch.equal(coords[1], torch.arange(0, 10_000, 100))
            (torch.Size([2, 100]), True)
        """
        if self.header:
            raise ValueError("unpack_rows: messages with a header hold a count each; unpack them one at a time")
        count = self.capacity
        values = self._read_values(messages, count)
        index = messages[..., self._index]
        if self.coding == "rice":
            return decode_index_rows(index, self.n, self.capacity, count), values
        return self._int32_coords(index, count), values

    def pack_rows(
        self, coords: Tensor, values: Tensor, counts: Tensor, out: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`pack_arriving` of messages with a header, a row each (``(rows, size)`` into ``out``, or new),
        byte for byte; row ``r`` of ``coords`` / ``values`` (``(rows, capacity)``) holds ``counts[r]`` pairs
        first (counts on the device); the arriving values are zero past the counts.

        Example:
            >>> layout = MessageLayout(n=1000, capacity=4, value_dtype=torch.float32, compact=True, header=True)
            >>> coords, values = torch.tensor([[3, 9, 0, 0], [5, 6, 7, 8]]), torch.ones(2, 4)
            >>> messages, _ = layout.pack_rows(coords, values, torch.tensor([2, 4]))
            >>> torch.equal(messages[0], layout.pack(coords[0, :2], values[0, :2]))
            True
        """
        if not self.header:
            raise ValueError("pack_rows: messages without a header hold exactly capacity pairs; use pack")
        rows, width = coords.shape
        if width != self.capacity:
            raise ValueError(f"pack_rows: rows of {width} pairs, not the capacity {self.capacity}")
        valid = torch.arange(width, device=coords.device) < counts.unsqueeze(1)
        if out is None:
            out = torch.zeros(rows, self.size, dtype=torch.uint8, device=coords.device)
        else:
            out.zero_()
        out[:, :4].view(torch.int32).copy_(counts.unsqueeze(1))
        at = self._values_at
        bits = self.value_bits
        values = torch.where(valid, values, 0)  # zero past the count: the scales and the bytes stay as pack's
        if bits is None:
            arriving = out[:, at : at + width * self.value_dtype.itemsize].view(self.value_dtype)
            arriving.copy_(values)
        else:
            codes, scales = quant.quantize_rows(values, bits)
            out[:, at : at + 2 * scales.shape[1]].view(torch.bfloat16).copy_(scales)
            at += quant.scale_bytes(self.capacity)
            quant.pack_code_rows(codes, valid, bits, out[:, at : at + quant.code_bytes(width, bits)])
            arriving = torch.where(valid, quant.dequantize(codes, scales, bits), 0.0)
        index = out[..., self._index]
        if self.coding == "rice":
            encode_index_rows(coords, counts, self.n, self.capacity, out=index)
        else:
            index[:, : width * _INDEX_BYTES].view(torch.int32).copy_(torch.where(valid, coords, 0))
        return out, arriving

    def unpack_counted_rows(self, messages: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(coordinates, values, counts)`` of every row of ``messages`` (with a header), counts on the
        device; past its count a row holds coordinate :attr:`n` (rows stay ascending) and value zero.

        Example:
            >>> layout = MessageLayout(n=1000, capacity=4, value_dtype=torch.float32, compact=True, header=True)
            >>> one = layout.pack(torch.tensor([3, 9]), torch.ones(2))
            >>> coords, values, counts = layout.unpack_counted_rows(torch.stack([one, one]))
            >>> coords[1].tolist(), values[1].tolist(), counts.tolist()
            ([3, 9, 1000, 1000], [1.0, 1.0, 0.0, 0.0], [2, 2])
        """
        if not self.header:
            raise ValueError("unpack_counted_rows: messages without a header; use unpack_rows")
        count = self.capacity
        counts = messages[:, :4].view(torch.int32).squeeze(1).long()
        valid = torch.arange(count, device=messages.device) < counts.unsqueeze(1)
        values = self._read_values(messages, count)
        if self.value_bits is not None:  # uncoded values are zero bytes past the count (pack zeroes the message)
            values = torch.where(valid, values, 0.0)
        index = messages[..., self._index]
        if self.coding == "rice":
            coords = decode_counted_rows(index, self.n, self.capacity, counts, fill=self.n)
        else:
            coords = torch.where(valid, self._int32_coords(index, count), self.n)
        return coords, values, counts

    def _read_values(self, messages: Tensor, count: int) -> Tensor:
        """The first ``count`` values of a message (or of each row)."""
        at = self._values_at
        bits = self.value_bits
        if bits is None:
            return messages[..., at : at + count * self.value_dtype.itemsize].view(self.value_dtype)
        scales = messages[..., at : at + quant.scale_bytes(count)].view(torch.bfloat16)
        at += quant.scale_bytes(self.capacity)
        codes = quant.unpack_codes(messages[..., at : at + quant.code_bytes(count, bits)], count, bits)
        return quant.dequantize(codes, scales, bits)

    @staticmethod
    def _int32_coords(index: Tensor, count: int) -> Tensor:
        return index[..., : count * _INDEX_BYTES].view(torch.int32).long()
