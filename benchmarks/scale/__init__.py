"""Wire bytes per rank per step against the number of ranks: dense, all-gather and split exchanges.

    python -m benchmarks scale
    python -m benchmarks scale --params 25e6 --measure-params 2e6 --world-sizes 2 4 8
    python -m benchmarks scale --json scale.json --plot wire_bytes.png

The model is a layer set like the step benchmark's: an MLP of ``--layers`` square Linear layers
(weight and bias each) holding about ``--params`` parameters, grouped into DDP-like buckets of at
most ``--bucket-mb`` MiB in reverse order (a tensor above the cap gets a bucket of its own). Top-k
at ``--density`` picks ``k_for(numel, density)`` coordinates of each tensor; tensors below
``min_numel`` (the biases of layers narrower than that) go dense. Each configuration's bytes
through one rank per optimizer step come from the package's own ring model, bucket by bucket:

- dense: ``ring_all_reduce_bytes`` of the bucket;
- the sparse configurations: :func:`lightning_sparse.exchange_cost` of the bucket (the exchange's
  own decisions and ring-model bytes: the sparse members' exchange plus the all-reduce of the
  members below ``min_numel``);
- allgather / split (int32 or compact indices): that exchange, no byte fallback;
- auto (the defaults of ``SparseConfig``: compact indices, the byte fallback on), and auto with
  bfloat16 values: the exchange ``exchange="auto"`` picks, and the whole bucket dense where the
  byte rule finds the sparse exchange no cheaper than dense.

Measured: for each of ``--world-sizes`` it starts that many processes (gloo over 127.0.0.1, one
torch thread each) that build the same buckets as real tensors at ``--measure-params`` parameters
and, per configuration, run one dense warm-up step and one sparse step of random gradients through
the hook's ``communicate``; the wire bytes are the hook's telemetry of the sparse step
(``Counters.wire_bytes``: counted from the messages handed to each collective). The benchmark
checks that every rank reports the same figures and that they equal the model's for the same
size (relative difference at most 1e-9), and raises otherwise.

It prints one markdown table (MB per rank per step and the ratio to dense) and checks the targets;
the exit code is 1 when one of them fails.
"""

from benchmarks.scale.cli import run
from benchmarks.scale.measure import TOLERANCE, check_measured, launch, measured_row, worker
from benchmarks.scale.model import (
    COLUMNS,
    CONFIGS,
    DENSE,
    GRAD_DTYPE,
    MODEL_WORLD_SIZES,
    Bucket,
    bucket_wire,
    ddp_buckets,
    describe_size,
    make_config,
    make_state,
    mlp_tensors,
    model_row,
)
from benchmarks.scale.options import add_arguments, check_arguments, parse_count
from benchmarks.scale.plots import plot
from benchmarks.scale.report import (
    HEADERS,
    TARGET_BYTES_PER_COORD,
    TARGET_FRACTION,
    TARGET_SPLIT_RATIO,
    TARGET_SPLIT_W,
    TARGET_W,
    format_table,
    targets,
)

__all__ = [
    "Bucket",
    "COLUMNS",
    "CONFIGS",
    "DENSE",
    "GRAD_DTYPE",
    "HEADERS",
    "MODEL_WORLD_SIZES",
    "TARGET_BYTES_PER_COORD",
    "TARGET_FRACTION",
    "TARGET_SPLIT_RATIO",
    "TARGET_SPLIT_W",
    "TARGET_W",
    "TOLERANCE",
    "add_arguments",
    "bucket_wire",
    "check_arguments",
    "check_measured",
    "ddp_buckets",
    "describe_size",
    "format_table",
    "launch",
    "make_config",
    "make_state",
    "measured_row",
    "mlp_tensors",
    "model_row",
    "parse_count",
    "plot",
    "run",
    "targets",
    "worker",
]
