"""Validation metric against bytes sent: dense DDP, each compressor at several densities (gradient and update
compression) and torch's own communication hooks, on real multi-process fits.

    python -m benchmarks convergence                                  # everything, hours on 2 cores
    python -m benchmarks convergence --tasks text --compressors topk dgc --densities 0.01 --epochs 2
    python -m benchmarks convergence --tasks gpt --compressors topk --densities 0.01 0.001 --modes update

For each task (``digits``: an MLP on scikit-learn's handwritten digits; ``text``: a GRU predicting
the next character of Python standard-library source; ``gpt``: a small transformer language model
on the same source, AdamW) it trains the same model from the same initial weights and data order
with dense DDP, with ``SparseDDPStrategy`` (error feedback on) for every compressor, density and
mode (``gradient``: the DDP comm hook sparsifies gradients; ``update``: each rank steps on its own
gradient and the strategy sparsifies the model update), and with torch's own DDP communication
hooks (``--peers``: PowerSGD of a given rank, fp16, bf16). Each run is a real
``lightning.Trainer(accelerator="cpu", devices=N)`` fit, launched as its own subprocess (Lightning's
popen launcher starts the other ranks; gloo; one thread per process), so a hung or crashed rank
shows as its row's status instead of hanging the benchmark.

Each task declares its metric: validation accuracy (higher is better) for digits and text,
validation loss in nats (lower is better) for gpt.

Bytes are what rank 0 handed to ``torch.distributed``: for sparse runs the strategy's telemetry
(values, indices, the dense small tensors, the dense first step, dense fallbacks); for dense DDP the
all-reduced gradients, optimizer steps x sum of parameter bytes, which is what the telemetry's
``dense_bytes`` counts too; for torch's hooks the tensors the hook handed to the collectives during
training steps (counted by wrapping ``torch.distributed``'s collectives in the worker). The metric
is the one after the last validation.

Writes to ``--out`` (default ``convergence_out``): ``convergence.md`` (one markdown table per
task), ``convergence.json`` (every run, with its metric after each validation against the bytes
sent until then) and ``convergence_<task>.png`` (the validation metric against cumulative bytes
sent, log x axis; needs matplotlib: ``pip install "lightning_sparse[plot]"``).
"""

from benchmarks.convergence.cli import DEFAULT_DENSITIES, DEFAULT_PEERS, MODES, add_arguments, run
from benchmarks.convergence.launcher import launch
from benchmarks.convergence.plots import plot
from benchmarks.convergence.results import report, table
from benchmarks.convergence.runs import ACCURACY, DENSE, VAL_LOSS, Metric, run_label
from benchmarks.convergence.targets import (
    GPT_TARGET_NATS,
    GPT_TARGETS,
    TARGET_DENSITY,
    TARGET_POINTS,
    TARGET_REDUCTION,
    gpt_target_check,
    target_check,
    value_within_bytes,
)
from benchmarks.convergence.tasks import GPT_CONTEXT, TASKS, ConvergenceTask
from benchmarks.convergence.worker import _sparse_strategy, fit_run

__all__ = [
    "ACCURACY",
    "ConvergenceTask",
    "DEFAULT_DENSITIES",
    "DEFAULT_PEERS",
    "DENSE",
    "GPT_CONTEXT",
    "GPT_TARGETS",
    "GPT_TARGET_NATS",
    "MODES",
    "Metric",
    "TARGET_DENSITY",
    "TARGET_POINTS",
    "TARGET_REDUCTION",
    "TASKS",
    "VAL_LOSS",
    "_sparse_strategy",
    "add_arguments",
    "fit_run",
    "gpt_target_check",
    "launch",
    "plot",
    "report",
    "run",
    "run_label",
    "table",
    "target_check",
    "value_within_bytes",
]
