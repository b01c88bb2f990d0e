"""Step time on a slow link: dense DDP against sparse_ddp with each compressor, in the same run.

    python -m benchmarks step --bandwidth 1gbit --world-size 2 --params 25e6
    python -m benchmarks step --bandwidth none            # unshaped loopback
    python -m benchmarks step --bandwidth 100mbit --latency 1ms --compressors topk randomk
    python -m benchmarks step --rev bfb574b --bandwidth none --compressors topk --modes update gradient

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
:mod:`benchmarks.peers`), fp16 and bf16 compression. Their bytes are those of the
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

``--rev REV`` compares the package as it is at a git revision (``bfb574b`` or later) with the
working tree's: the package at REV is extracted from git (``git archive``, as ``python -m
benchmarks identical`` does) and the same runs are launched under the old package and under the
working tree's in turn, ``--rounds`` launches of each (old, new, old, new, ...: a busy machine
slows both alike); only ``lightning_sparse`` comes from REV, the driver and the worker are the
working tree's, and each rank checks which package it imported. It prints per run the median step
under each code (the median over its launches of each launch's median), new / old (below 1: the
new code is faster) and the bytes each rank sent per step under each (equal when both send the
same messages). Not with ``--peers`` or ``--unshaped-baseline``.
"""

from benchmarks.step.cli import run
from benchmarks.step.launcher import failure_reason
from benchmarks.step.link import ShapedLink, describe_link
from benchmarks.step.options import (
    DEFAULT_COMPRESSORS,
    DENSE,
    FALLBACKS,
    Exchange,
    add_arguments,
    parse_latency,
    parse_params,
    parse_rate,
)
from benchmarks.step.report import failed_row, format_old_new, format_table, old_new_rows
from benchmarks.step.worker import model_shape, worker

__all__ = [
    "DEFAULT_COMPRESSORS",
    "DENSE",
    "Exchange",
    "FALLBACKS",
    "ShapedLink",
    "add_arguments",
    "describe_link",
    "failed_row",
    "failure_reason",
    "format_old_new",
    "format_table",
    "model_shape",
    "old_new_rows",
    "parse_latency",
    "parse_params",
    "parse_rate",
    "run",
    "worker",
]
