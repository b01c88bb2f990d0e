"""Benchmarks: ``python -m lightning_sparse.bench <command> --help``.

Each command is a module of this package with ``add_arguments(parser)`` and ``run(args)``;
figures are printed as ratios against a baseline measured in the same run.
"""

#: command -> module implementing it
COMMANDS: dict[str, str] = {
    "compressors": "lightning_sparse.bench.compressors",
    "step": "lightning_sparse.bench.step",
    "convergence": "lightning_sparse.bench.convergence",
    "scale": "lightning_sparse.bench.scale",
}
