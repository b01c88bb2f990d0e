"""The wire: how a bucket's compressed contents cross between ranks, what that costs, and what it keeps.

It imports neither Lightning nor the settings class, and sees the exchange's state only through :class:`WireContext`
and :class:`BucketCall`.
"""

from lightning_sparse.wire.comm import Collectives
from lightning_sparse.wire.context import Average, BucketCall, BucketPlan, Member, Pending, WireContext
from lightning_sparse.wire.message import MessageLayout, SparseSpace
from lightning_sparse.wire.patterns import (
    DENSE,
    EXCHANGES,
    GATHER,
    PATTERNS,
    SPLIT_AUTO_RATIO,
    GatherPattern,
    WirePattern,
    bucket_wire_bytes,
)
from lightning_sparse.wire.split import SPLIT_BLOCK, Regions, split_capacities, split_wire_bytes
from lightning_sparse.wire.stats import (
    count_all_gather,
    count_all_reduce,
    count_all_to_all,
    count_dense,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    sparse_pays,
)

__all__ = [
    "DENSE",
    "EXCHANGES",
    "GATHER",
    "PATTERNS",
    "SPLIT_AUTO_RATIO",
    "SPLIT_BLOCK",
    "Average",
    "BucketCall",
    "BucketPlan",
    "Collectives",
    "GatherPattern",
    "Member",
    "MessageLayout",
    "Pending",
    "Regions",
    "SparseSpace",
    "WireContext",
    "WirePattern",
    "bucket_wire_bytes",
    "count_all_gather",
    "count_all_reduce",
    "count_all_to_all",
    "count_dense",
    "ring_all_gather_bytes",
    "ring_all_reduce_bytes",
    "sparse_pays",
    "split_capacities",
    "split_wire_bytes",
]
