"""Print the end-of-fit summaries and the CSV figures that docs/telemetry.md shows, from real runs.

    python docs/scripts/telemetry_sample.py

In a temporary directory, in one 2-process launch (digits MLP, 2 CPU processes, seed 0, one thread
per process), this fits with the Lightning CLI example twice, as the page's commands do:

- ``python examples/cli.py fit --config examples/configs/topk.yaml --trainer.max_epochs 2`` (the
  defaults), then reads its ``metrics.csv`` back as the page's Python block does;
- the same with local steps and 2-bit values (``sync_every=4``, ``value_bits=2``, DiLoCo's outer
  step).

The progress bar and Lightning's model summary are off; they change nothing in the figures. Rank 0
prints one section per figure shown on the page, each under a ``==> `` line that names where it
comes from. Everything is the same from run to run on the same machine except the timings: the
``compress s`` and ``% of step`` columns of the summaries. tests/test_telemetry_page.py runs this
script and checks that the page shows what it prints (the timings masked).
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

import lightning_sparse

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "examples/configs/topk.yaml"
FIT = ["--trainer.max_epochs", "2"]
LOCAL_STEPS = [
    "--trainer.strategy.init_args.sync_every",
    "4",
    "--trainer.strategy.init_args.value_bits",
    "2",
    "--trainer.strategy.init_args.outer_optimizer",
    "nesterov",
]
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
CSV_PATH = "lightning_logs/topk/version_0/metrics.csv"


def _cli() -> object:
    spec = importlib.util.spec_from_file_location("lightning_sparse_example_cli", ROOT / "examples" / "cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fit(cli: object, args: list[str]) -> tuple[str, int]:
    """Fit ``examples/cli.py fit --config topk.yaml ARGS``; (what the summary printed on this rank, the rank)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run = cli.main(["fit", "--config", str(ROOT / CONFIG), *args, *QUIET])  # type: ignore[attr-defined]
    text = out.getvalue()
    start = text.find("Sparse update communication:")
    return (text[start:].rstrip("\n") if start >= 0 else ""), run.trainer.global_rank


def main() -> None:
    torch.set_num_threads(1)
    sys.argv[0] = os.path.abspath(sys.argv[0])  # the launcher re-runs this script from the directory below
    # where the run started (the launcher starts the other rank in this rank's working directory,
    # which this rank removes at the end: every rank goes back to the first one's)
    home = os.environ.setdefault("TELEMETRY_SAMPLE_HOME", os.getcwd())
    work = tempfile.mkdtemp(prefix="telemetry_sample_")
    os.chdir(work)
    try:
        cli = _cli()
        sections = []
        summary, rank = _fit(cli, FIT)
        sections.append((f"summary: python examples/cli.py fit --config {CONFIG} {' '.join(FIT)}", summary))
        if rank == 0:  # the page's Python block, on the CSV this run wrote
            with open(CSV_PATH, newline="") as f:
                rows = [r for r in csv.DictReader(f) if r["sparse/compression_ratio"]]
            last = rows[-1]
            line = f"{last['step']} {last['sparse/compression_ratio_cumulative']} {last['sparse/bytes_sent']}"
            sections.append((f"csv: {CSV_PATH}", line))
        shutil.rmtree("lightning_logs", ignore_errors=True)
        summary, rank = _fit(cli, FIT + LOCAL_STEPS)
        args = " ".join(FIT + LOCAL_STEPS)
        sections.append((f"summary: python examples/cli.py fit --config {CONFIG} {args}", summary))
        if rank == 0:
            for heading, text in sections:
                print(f"==> {heading}\n{text}")
    finally:
        os.chdir(home)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
    lightning_sparse.end_process_group(exit_code=0)  # every rank together, before Python's own shutdown
