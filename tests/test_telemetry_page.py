"""docs/telemetry.md shows what docs/scripts/telemetry_sample.py prints from real 2-process fits.

The script fits the digits MLP with the Lightning CLI example (2 CPU processes, seed 0) as the page's
commands do, and prints each end-of-fit summary and the figures the page's Python block reads back
from the CSV, each under a ``==> KIND: SOURCE`` line. Every figure must be on the page as printed,
except the timings (the ``compress s`` and ``% of step`` columns), which vary from run to run and are
masked on both sides; so are the column padding and the length of the rules, which follow the widest
cell.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sparse.telemetry.summary import COLUMNS

pytest.importorskip("jsonargparse")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "telemetry.md"
SCRIPT = ROOT / "docs" / "scripts" / "telemetry_sample.py"
#: the summary's columns that vary from run to run (host time)
TIMED = ("compress s", "% of step")


def normalise(table: str) -> list[str]:
    """A printed summary, line by line, with the timings masked and the padding ignored.

    Example:
        >>> normalise("t\\n-----\\nx  1  2 B  3 B  1.0x  1.0x  1.0000  0.123  4.5%")
        ['t', '---', 'x | 1 | 2 B | 3 B | 1.0x | 1.0x | 1.0000 | <time> | <time>']
        >>> normalise("waiting for exchanges took 0.14 s.")
        ['waiting for exchanges took <time> s.']
    """
    out = []
    for line in table.strip("\n").splitlines():
        if line.strip() and set(line.strip()) == {"-"}:
            out.append("---")
            continue
        line = re.sub(r"waiting for exchanges took [\d.]+ s", "waiting for exchanges took <time> s", line)
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 1 + len(COLUMNS):  # a row: its name, then one cell per column
            for name in TIMED:
                cells[1 + COLUMNS.index(name)] = "<time>"
        out.append(" | ".join(cells))
    return out


def plain_blocks(page: str) -> list[str]:
    """The page's output blocks (fenced with ``` and no language)."""
    found, lines, i = [], page.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = lines.index("```", i + 1)
            if lines[i] == "```":
                found.append("\n".join(lines[i + 1 : end]))
            i = end
        i += 1
    return found


def sections(output: str) -> list[tuple[str, str, str]]:
    """(kind, source, text) for each ``==> KIND: SOURCE`` section the script printed."""
    found = []
    for part in re.split(r"^==> ", output, flags=re.M)[1:]:
        heading, _, text = part.partition("\n")
        kind, _, source = heading.partition(": ")
        found.append((kind, source, text.rstrip("\n")))
    return found


def test_normalise_masks_only_the_timings() -> None:
    a = "x          10   1.00 MB  10.00 kB  100.0x  100.0x  0.0100  0.100   1.0%"
    b = "x  10  1.00 MB  10.00 kB  100.0x  100.0x  0.0100  12.345  99.9%"
    assert normalise(a) == normalise(b)
    assert normalise(a) != normalise(b.replace("10.00 kB", "10.01 kB"))
    assert set(TIMED) <= set(COLUMNS)


@pytest.mark.dist
def test_telemetry_page_shows_what_the_sample_prints(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    printed = sections(proc.stdout)
    assert [kind for kind, _, _ in printed] == ["summary", "csv", "summary"], proc.stdout
    page = PAGE.read_text()
    prose = " ".join(page.split())  # inline code may wrap across lines in the page's source
    shown = [normalise(block) for block in plain_blocks(page)]
    for kind, source, text in printed:
        if kind == "summary":
            # the page names the command and each of its options (the second run: "the same command with ...")
            assert source.startswith("python examples/cli.py fit --config examples/configs/topk.yaml ")
            assert "python examples/cli.py fit --config examples/configs/topk.yaml" in prose
            for option in re.findall(r"--\S+ \S+", source.split(".yaml ", 1)[1]):
                assert option in prose, f"{PAGE.name} does not name {option!r} of {source!r}"
            assert normalise(text) in shown, f"{PAGE.name} does not show what {source!r} printed:\n{text}"
        else:  # the page's Python block reads this CSV and shows the figures in its last comment
            assert f'open("{source}", newline="")' in page
            assert f"\n# {text}\n```" in page, f"{PAGE.name}: the CSV block's comment should read '# {text}'"
