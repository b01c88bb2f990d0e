"""Lightning CLI for the digits task: configure SparseDDPStrategy from YAML.

    pip install -e ".[examples]"
    python examples/cli.py fit --config examples/configs/topk.yaml
    python examples/cli.py fit --config examples/configs/topk.yaml --print_config
    python examples/cli.py fit --trainer.strategy.help lightning_sparse.SparseDDPStrategy

Every config in ``examples/configs/`` trains the digits MLP on 2 CPU processes; any value can be
overridden on the command line (``--trainer.max_epochs 3``, ``--trainer.strategy.init_args.density
0.05``). The compression figures go to the configured logger (``sparse/...`` metrics) and a
summary table is printed at the end of fit.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_sparse  # noqa: F401  (registers strategy="sparse_ddp"; makes its classes known to the CLI)
from lightning_sparse.demos import DigitsClassifier, DigitsDataModule

#: what every subcommand's --help ends with: the strategy's own arguments are listed by its own help
STRATEGY_HELP = (
    "The strategy's arguments (every setting of the sparse exchange, its type, default and doc): "
    "--trainer.strategy.help lightning_sparse.SparseDDPStrategy (sharded models: "
    "lightning_sparse.SparseFSDPStrategy); docs/arguments.md lists them too."
)


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Build (and with ``run``, execute) the CLI; ``args`` default to the command line."""
    return LightningCLI(
        DigitsClassifier,
        DigitsDataModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={sub: {"epilog": STRATEGY_HELP} for sub in ("fit", "validate", "test", "predict")},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
