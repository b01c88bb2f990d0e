"""What crosses the wire, in bytes: the ring models and the byte rule.

Through each rank, a ring all-gather of ``m`` bytes per rank moves ``(W-1)*m`` bytes, a ring all-reduce
of ``n`` bytes ``2*(W-1)/W*n``, an all-to-all of ``n`` bytes ``(W-1)/W*n``. :func:`sparse_pays` is the
byte rule that the hook, the density schedules and the telemetry all ask.
"""

from __future__ import annotations

from lightning_sparse.wire.stats import Counters


def ring_all_reduce_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-reduce of ``nbytes``."""
    return 2.0 * (world - 1) / world * nbytes


def ring_all_gather_bytes(world: int, nbytes: int) -> float:
    """Bytes through each rank for a ring all-gather of ``nbytes`` per rank."""
    return float((world - 1) * nbytes)


def count_all_reduce(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-reduce of ``nbytes`` this rank issued: the bytes handed to it, and its ring traffic."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += ring_all_reduce_bytes(world, nbytes)


def count_all_gather(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-gather of ``nbytes`` per rank this rank issued (see :func:`count_all_reduce`)."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += ring_all_gather_bytes(world, nbytes)


def count_all_to_all(counters: Counters, world: int, nbytes: int) -> None:
    """Count an all-to-all of ``nbytes`` (all W chunks) this rank issued: every chunk but its own leaves."""
    counters.sent_bytes += nbytes
    counters.wire_bytes += (world - 1) / world * nbytes if world > 1 else 0.0


def count_dense(counters: Counters, world: int, nbytes: int) -> None:
    """Record ``nbytes`` of gradient that plain DDP would all-reduce, and what that would move."""
    counters.dense_bytes += nbytes
    counters.dense_wire_bytes += ring_all_reduce_bytes(world, nbytes)


def sparse_pays(sparse_wire: float, world: int, dense_bytes: int) -> bool:
    """The byte rule: whether a sparse exchange moving ``sparse_wire`` bytes through each rank moves
    fewer than a dense all-reduce of ``dense_bytes``. At world size 1 dense (exact) is chosen.

    Example:
        >>> sparse_pays(100.0, world=2, dense_bytes=4000), sparse_pays(0.0, world=1, dense_bytes=4000)
        (True, False)
    """
    return sparse_wire < ring_all_reduce_bytes(world, dense_bytes)
