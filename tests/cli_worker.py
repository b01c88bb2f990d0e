"""Fit from several LightningCLI configs in one 2-process launch (the popen launcher re-runs this).

    python cli_worker.py OUT_DIR CONFIG.yaml [CONFIG.yaml ...]

Each config runs ``examples/cli.py fit --config CONFIG`` for a few steps with a CSVLogger writing
to ``OUT_DIR/<config name>/``; starting the processes once keeps the test fast.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

SHORT_FIT = [
    "--trainer.max_steps=9",  # past the first exchange of every config (the "1000x" preset's: step 4)
    "--trainer.limit_train_batches=3",
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_model_summary=false",
    "--model.hidden=[64]",
]


def main() -> None:
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("lightning_sparse_example_cli", ROOT / "examples" / "cli.py")
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = Path(sys.argv[1])
    for config in sys.argv[2:]:
        name = Path(config).stem
        logger = [
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={out / name}",
            "--trainer.logger.name=csv",
            "--trainer.logger.version=0",
        ]
        cli.main(["fit", "--config", config, *SHORT_FIT, *logger])


if __name__ == "__main__":
    main()
