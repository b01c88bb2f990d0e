"""Step time of a many-tensor transformer on a GPU: the floor, dense DDP and the sparse exchange.

    python -m benchmarks gpu --json gpu_step.json                     # GPT-2 small's shape, CUDA
    python -m benchmarks gpu --accelerator cpu --model tiny --steps 4 # a quick run on CPUs

Every row runs a Fabric loop (forward, ``fabric.backward``, AdamW's step) of a GPT
(``lightning_sparse.demos.gpt.TinyGPT`` in GPT-2 small's shape: 12 blocks of width 768, 148
tensors; bf16 autocast on CUDA) in ``--world-size`` processes, each on its own random tokens.
Processes share one GPU over gloo (NCCL refuses two ranks on one device), or take one GPU each over
NCCL where there are as many. The rows, one after the other:

- ``floor``: the processes run independent single-process loops at the same time (what the
  device does with no communication at all);
- ``dense``: Lightning's ``DDPStrategy``;
- ``default``: ``lightning_sparse.fabric.SparseDDPStrategy()`` with its defaults (update mode);
- ``every4``: ``sync_every=4, value_bits=2, warmup_steps=0``;
- ``every4-fragments``: the same with ``fragments=4, sync_delay=1``.

A row reports the mean and the median step of its slower process (each step timed to the device's
end of it), the ratio of the mean to the floor's, the package's collectives per exchange (its
calls of ``lightning_sparse.wire.comm``'s collectives over the timed steps, by the exchange
counter), and, from ``torch.profiler`` over ``--profile-steps`` steps on rank 0, per step (in a
second set of processes: a process that has profiled CUDA activity launches kernels slower
afterwards, so no timed step runs after a profile):
host synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
``cudaEventSynchronize``), scalar reads (``aten::_local_scalar_dense``), ``aten::nonzero``, kernel
launches, ATen operators and the collectives' own events. ``--json`` writes every figure.
"""

from benchmarks.gpu.cli import format_table, run, summarise
from benchmarks.gpu.options import MODELS, RUNS, Run, add_arguments
from benchmarks.gpu.worker import build_model, profile_counts, worker

__all__ = [
    "MODELS",
    "RUNS",
    "Run",
    "add_arguments",
    "build_model",
    "format_table",
    "profile_counts",
    "run",
    "summarise",
    "worker",
]
