"""Benchmarks: ``python -m benchmarks <command> --help``.

Each command is a module of this package with ``add_arguments(parser)`` and ``run(args)``;
figures are printed as ratios against a baseline measured in the same run.
"""

#: command -> module implementing it
COMMANDS: dict[str, str] = {
    "compressors": "benchmarks.compressors",
    "step": "benchmarks.step",
    "convergence": "benchmarks.convergence",
    "scale": "benchmarks.scale",
    "checkpoint": "benchmarks.checkpoint",
    "sharding": "benchmarks.sharding",
    "gpu": "benchmarks.gpu",
    "parties": "benchmarks.parties",
    "ft": "benchmarks.ft",
    "identical": "benchmarks.identical",
    "calls": "benchmarks.calls",
}
