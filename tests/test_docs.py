"""The README and the documentation pages: every code block is run or is a command a test runs.

- ```python blocks run in a subprocess (one thread, under a timeout), each distinct block once.
  A block preceded by ``<!-- not-run: REASON -->`` is not run; REASON must name a test that runs
  the same thing (``tests/test_x.py::test_y``, which must exist) or an example file (which a test
  must run, or, while it is not in this tree yet, be listed in ``PENDING_FILES``).
- ```bash blocks: every command must be in ``COMMANDS``, which names the test (or ``.ci/run``)
  that runs it; the named test must exist and mention the program the command runs.
- ```yaml, ```text and plain ``` blocks are data or output.
- The README stays a landing page: at most 250 lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250
DATA_LANGUAGES = {"", "yaml", "text"}

# Files named by a not-run marker that are being written elsewhere and are not in this tree yet.
PENDING_FILES: dict[str, str] = {}

# Every shell command shown in the docs -> the test that runs it. The tests run the same program
# with the same options, but briefly (one epoch, a few steps, small tensors, one machine); ".ci/run"
# means CI runs the command exactly as written.
COMMANDS = {
    # README / getting started: the two set-up commands
    'pip install torch==2.13.0 && pip install -e ".[examples]" && python examples/train_digits.py': ".ci/run",
    'pip install torch==2.13.0 && pip install -e ".[dev]" && ruff check . && ruff format --check . && mypy '
    "&& python -m pytest -n 2 --dist loadfile && python -m pytest --doctest-modules lightning_sparse": ".ci/run",
    'pip install -e ".[docs]" && mkdocs build --strict': ".ci/run",
    # Lightning CLI
    "python examples/cli.py fit --config examples/configs/topk.yaml": (
        "tests/test_cli.py::test_configs_fit_on_two_processes"
    ),
    "python examples/cli.py fit --config examples/configs/topk.yaml --trainer.strategy.init_args.density 0.05": (
        "tests/test_cli.py::test_a_command_line_option_overrides_the_config"
    ),
    "python examples/cli.py fit --config examples/configs/topk.yaml --print_config": (
        "tests/test_cli.py::test_print_config_shows_every_strategy_and_compressor_argument"
    ),
    "python examples/cli.py fit --trainer.strategy.help lightning_sparse.SparseDDPStrategy": (
        "tests/test_cli.py::test_strategy_help_shows_type_and_default_of_every_argument"
    ),
    "python examples/cli.py fit --config examples/configs/topk.yaml --trainer.strategy.compressor.help TopK": (
        "tests/test_cli.py::test_compressor_help_shows_its_arguments"
    ),
    # Results: step time (the tests shape the link too, when they can; small model, 2 steps)
    "python -m benchmarks step --bandwidth 1gbit --params 25e6 --compressors topk randomblock "
    "--modes update gradient --peers powersgd:4 fp16": "benchmarks/tests/test_bench_step.py::test_step_bench_shaped",
    "python -m benchmarks step --bandwidth 1gbit --params 25e6 --compressors topk randomblock "
    "--modes update gradient --peers powersgd:4 fp16 --fallback time": (
        "benchmarks/tests/test_bench_step.py::test_step_bench_timed_fallback"
    ),
    "python -m benchmarks step --bandwidth none --params 25e6 --compressors topk randomblock "
    "--modes update gradient --peers powersgd:4 fp16": "benchmarks/tests/test_bench_step.py::test_step_bench_peers",
    "python -m benchmarks step --bandwidth none --params 25e6 --compressors topk randomblock "
    "--modes update gradient --peers powersgd:4 fp16 --fallback time --steps 30": (
        "benchmarks/tests/test_bench_step.py::test_step_bench_timed_fallback"
    ),
    # Results: step time on a GPU (the test: on CPUs, a tiny GPT, 4 steps)
    "python -m benchmarks gpu --steps 30 --warmup 6 --profile-steps 3 --runs floor dense default every4 "
    'every4-fragments local --variants \'local={"sync_every": 100000, "warmup_steps": 0}\' --json gpu_step.json': (
        "benchmarks/tests/test_bench_gpu.py::test_gpu_bench_runs_every_row_on_cpus"
    ),
    # Results: what grows with the number of parties (the test: 2 processes, a tiny GPT)
    "python -m benchmarks parties --parties 2 4 8 --json parties.json": (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_dense_and_sparse_rows"
    ),
    "python -m benchmarks parties --parties 4 8 2 --json count_gpt.json": (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_dense_and_sparse_rows"
    ),
    "python -m benchmarks parties --parties 16 --only default every4 --json count_gpt16.json": (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_dense_and_sparse_rows"
    ),
    "python -m benchmarks parties --parties 2 4 8 --variants 'diloco4={\"diloco\": 4}' 'diloco16={\"diloco\": 16}' "
    "--json diloco.json": "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_dense_and_sparse_rows",
    "python -m benchmarks parties --task text --parties 2 4 8 --variants 'diloco16={\"diloco\": 16}' "
    '\'nest4b2={"sync_every": 4, "outer_optimizer": "nesterov", "value_bits": 2, "warmup_steps": 0}\' '
    "--json text.json": "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_the_text_task",
    'python -m benchmarks parties --parties 2 4 8 --variants \'d4b4={"density": 0.04, "value_bits": 4}\' '
    "--only default d4b4 --json denser.json": (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_dense_and_sparse_rows"
    ),
    'python -m benchmarks parties --task text --parties 2 4 --variants \'d2b8={"density": 0.02, "value_bits": 8}\' '
    '\'d4b4={"density": 0.04, "value_bits": 4}\' --only default d2b8 d4b4 --json denser_text.json': (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_the_text_task"
    ),
    'python -m benchmarks parties --parties 2 4 --variants \'d4={"dense": true, "lr": 0.004}\' '
    '\'full4={"lr": 0.004, "density": 1.0}\' \'full1={"density": 1.0}\' --only d4 full4 full1': (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_uncompressed_corrected_and_gradient_rows"
    ),
    'python -m benchmarks parties --parties 2 4 --variants \'nf1={"density": 1.0, "noise_correct": true}\' '
    '\'nf4={"density": 1.0, "lr": 0.004, "noise_correct": true}\' --only nf1 nf4': (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_uncompressed_corrected_and_gradient_rows"
    ),
    'python -m benchmarks parties --parties 2 4 --variants \'dc4={"dense": true, "lr": 0.004, "clip": 0}\' '
    '\'fc4={"lr": 0.004, "density": 1.0, "clip": 0}\' \'c4={"lr": 0.004, "clip": 0}\' --only dc4 fc4 c4': (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_uncompressed_corrected_and_gradient_rows"
    ),
    "python -m benchmarks parties --parties 2 4 8 --variants 'diloco16={\"diloco\": 16}' "
    '\'split={"exchange": "split"}\' \'splitplain={"exchange": "split", "chosen_scale": 1.0}\' '
    "--json default_gpt.json": (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_the_probes_and_the_plain_average"
    ),
    "python -m benchmarks parties --task text --parties 2 4 8 --variants 'diloco16={\"diloco\": 16}' "
    "--json default_text.json": "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_the_text_task",
    'python -m benchmarks parties --task text --parties 2 4 8 --variants \'d04={"dense": true, "lr": 0.4}\' '
    '\'d08={"dense": true, "lr": 0.8}\' \'c04={"lr": 0.4}\' \'c08={"lr": 0.8}\' '
    '\'p04={"lr": 0.4, "chosen_scale": 1.0}\' \'p08={"lr": 0.8, "chosen_scale": 1.0}\' '
    "--only d04 d08 c04 c08 p04 p08": ("benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_the_text_task"),
    'python -m benchmarks parties --parties 4 --variants \'d4={"dense": true, "lr": 0.004}\' '
    '\'c4x={"lr": 0.004, "clip_by": "exact", "chosen_scale": 1.0}\' \'f4x={"lr": 0.004, "density": 1.0, "clip_by": '
    '"exact"}\' \'c4l={"lr": 0.004, "clip_by": "local", "chosen_scale": 1.0}\' --only d4 c4x f4x c4l': (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_the_probes_and_the_plain_average"
    ),
    'python -m benchmarks parties --parties 4 --variants \'d4={"dense": true, "lr": 0.004}\' '
    '\'sinv={"lr": 0.004, "own_share": "parties", "chosen_scale": 1.0}\' \'szero={"lr": 0.004, "own_share": 0, '
    '"chosen_scale": 1.0}\' \'shalf={"lr": 0.004, "own_share": 0.5, "chosen_scale": 1.0}\' '
    "--only d4 sinv szero shalf": (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_the_probes_and_the_plain_average"
    ),
    'python -m benchmarks parties --parties 8 --variants \'d2={"dense": true, "lr": 0.002}\' '
    '\'d4={"dense": true, "lr": 0.004}\' \'c2={"lr": 0.002}\' \'c4={"lr": 0.004}\' --only d2 d4 c2 c4': (
        "benchmarks/tests/test_bench_parties.py::test_parties_bench_runs_dense_and_sparse_rows"
    ),
    # Results: accuracy against bytes (the test: --tiny)
    "python -m benchmarks convergence --tasks gpt --compressors topk --densities 0.01 0.001 "
    "--modes update gradient --peers powersgd:1 powersgd:4 --out docs/convergence/gpt": (
        "benchmarks/tests/test_bench_convergence.py::test_convergence_gpt_tiny_with_peers"
    ),
    "python -m benchmarks convergence --tasks digits --densities 0.01 0.001 --modes update gradient "
    "--peers powersgd:1 powersgd:4 --out docs/convergence/digits": (
        "benchmarks/tests/test_bench_convergence.py::test_convergence_tiny_run"
    ),
    "python -m benchmarks convergence --tasks text --densities 0.01 --modes update gradient "
    "--peers powersgd:1 powersgd:4 --out docs/convergence/text": (
        "benchmarks/tests/test_bench_convergence.py::test_convergence_tiny_run"
    ),
    "python -m benchmarks convergence --tasks gpt --compressors topk --densities 0.01 --modes update "
    "--exchanges allgather split --devices 4 --peers powersgd:4": (
        "benchmarks/tests/test_bench_convergence.py::test_convergence_exchanges_on_4_processes"
    ),
    "python -m benchmarks step --bandwidth 1gbit --params 25e6 --compressors topk --modes update "
    "gradient --peers powersgd:4": "benchmarks/tests/test_bench_step.py::test_step_bench_peers",
    "python -m benchmarks step --bandwidth 1gbit --world-size 4 --params 25e6 --compressors topk "
    "--modes update gradient --exchanges allgather split --peers powersgd:4": (
        "benchmarks/tests/test_bench_step.py::test_step_bench_exchanges_on_4_ranks"
    ),
    # Results: exchanging rarely and in few bits (the test: --tiny, the variants and the library's peers)
    "python -m benchmarks convergence --tasks gpt --compressors topk --densities 0.01 --modes update "
    '--variants "" --peers powersgd:1 diloco:16 demo': (
        "benchmarks/tests/test_bench_convergence.py::test_convergence_variants_and_library_peers"
    ),
    "python -m benchmarks convergence --tasks gpt --compressors topk --densities 0.01 --modes update "
    '--no-dense --peers torchft:16 --variants "value_bits=2" "sync_every=4,value_bits=2,warmup=0" '
    '"sync_every=8,value_bits=2,warmup=0" "sync_every=16,outer=nesterov,value_bits=2,warmup=0" '
    '"sync_every=4,value_bits=2" "sync_every=4,outer=nesterov,value_bits=2" '
    '"sync_every=16,outer=nesterov,value_bits=2"': (
        "benchmarks/tests/test_bench_convergence.py::test_convergence_variants_and_library_peers"
    ),
    "python -m benchmarks convergence --tasks text digits --compressors topk --densities 0.01 --modes "
    'update --peers diloco:16 torchft:16 --variants "" "value_bits=2" "sync_every=4,value_bits=2,warmup=0" '
    '"sync_every=8,value_bits=2,warmup=0" "sync_every=16,outer=nesterov,value_bits=2,warmup=0"': (
        "benchmarks/tests/test_bench_convergence.py::test_convergence_variants_and_library_peers"
    ),
    # Results: hiding the exchange (the tests: a small model, 8 steps; the tiny GPT)
    "python -m benchmarks step --bandwidth 10mbit --unshaped-baseline --compressors topk --modes update "
    "--sync-every 4 --sync-delay 0 1 2 --fragments 1 4 --value-bits 2 --warmup-exchanges 0 --steps 24 "
    "--warmup 8": "benchmarks/tests/test_bench_step.py::test_step_bench_delay_and_fragments_against_unshaped",
    "python -m benchmarks convergence --tasks gpt --compressors topk --densities 0.01 --modes update "
    '--variants "sync_every=4,value_bits=2,warmup=0" "sync_every=4,value_bits=2,warmup=0,delay=1" '
    '"sync_every=4,value_bits=2,warmup=0,fragments=4,delay=1" '
    '"sync_every=4,value_bits=2,warmup=0,fragments=4,delay=1,split=contiguous"': (
        "benchmarks/tests/test_bench_convergence.py::test_convergence_delay_and_fragment_variants"
    ),
    # Wire bytes at scale (the test: a small model, 2 and 4 processes)
    "python -m benchmarks scale --json docs/scale/scale.json --plot docs/scale/wire_bytes.png": (
        "benchmarks/tests/test_bench_scale.py::test_measured_equals_model"
    ),
    # Results: density schedules (the test: one seed, one epoch)
    "python examples/compare_schedules.py --c0 3000 10000 100000": (
        "tests/test_examples.py::test_compare_schedules_runs"
    ),
    "python examples/compare_schedules.py --c0 3000 10000 100000 --no-error-feedback": (
        "tests/test_examples.py::test_compare_schedules_runs"
    ),
    # Multi-node launch: one machine only; several machines are not tested
    "torchrun --nnodes 1 --nproc-per-node 2 examples/multinode.py --devices 2": (
        "tests/test_examples.py::test_multinode_under_torchrun"
    ),
    "torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 "
    "examples/multinode.py --num-nodes 2 --devices 8 --accelerator gpu": (
        "tests/test_examples.py::test_multinode_two_nodes_under_torchrun"
    ),
    "srun python examples/multinode.py --num-nodes 2 --devices 8 --accelerator gpu": (
        "tests/test_examples.py::test_multinode_under_slurm_variables"
    ),
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None  # the reason, when a <!-- not-run: ... --> comment precedes the block

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(.+?)\s*-->\s*$")


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, language = m.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        assert end < len(lines), f"{page}:{i + 1}: unclosed code block"
        code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end]) + "\n"
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before)
        found.append(Block(page, i + 1, language.lower(), code, marker.group(1) if marker else None))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.language == "python"]
BASH = [b for b in ALL if b.language in ("bash", "sh", "shell", "console")]
TO_RUN: dict[str, Block] = {}
for _b in PYTHON:
    if _b.not_run is None:
        TO_RUN.setdefault(_b.code, _b)  # the README and the pages share some blocks: run each once


def commands(code: str) -> list[str]:
    """The commands of a shell block: lines without comments, trailing comments and extra spaces."""
    out = []
    for line in code.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(" ".join(line.split()))
    return out


def _test_exists(ref: str) -> str:
    """Check ``tests/file.py::test_name`` exists; return the test file's source."""
    path, _, name = ref.partition("::")
    file = ROOT / path
    assert file.is_file(), f"{ref}: no such file"
    source = file.read_text()
    assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{ref}: no such test"
    return source


def _program(command: str) -> str:
    """What a command runs: the script (``examples/x.py``) or module (``-m pkg.mod``) in its last part."""
    words = command.split("&&")[-1].split()
    for i, word in enumerate(words):
        if word.endswith(".py"):
            return Path(word).name
        if word == "-m" and i + 1 < len(words):
            return words[i + 1]
    return words[0]


def test_found_the_blocks() -> None:
    assert len(PYTHON) >= 10 and len(BASH) >= 8 and len(TO_RUN) >= 5


def test_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("block", ALL, ids=[b.where for b in ALL])
def test_block_language_is_known(block: Block) -> None:
    assert block.language in DATA_LANGUAGES | {"python", "bash"}, f"{block.where}: ```{block.language}"
    if block.not_run is not None:
        assert block.language == "python", f"{block.where}: only python blocks can be marked not-run"


@pytest.mark.parametrize("block", BASH, ids=[b.where for b in BASH])
def test_shell_commands_are_ones_a_test_runs(block: Block) -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    for command in commands(block.code):
        assert command in COMMANDS, f"{block.where}: no test runs {command!r}; add one and list it in COMMANDS"
        ref = COMMANDS[command]
        if ref == ".ci/run":
            assert command in ci, f"{block.where}: .ci/run does not run {command!r} as written"
        else:
            source = _test_exists(ref)
            assert _program(command) in source, f"{ref} does not mention {_program(command)!r}"


def test_every_listed_command_is_still_in_the_docs() -> None:
    shown = {c for b in BASH for c in commands(b.code)}
    assert not set(COMMANDS) - shown, "COMMANDS lists commands no page shows any more"


NOT_RUN_BLOCKS = [b for b in PYTHON if b.not_run is not None]


@pytest.mark.parametrize("block", NOT_RUN_BLOCKS, ids=[b.where for b in NOT_RUN_BLOCKS])
def test_not_run_blocks_name_what_covers_them(block: Block) -> None:
    tests = re.findall(r"tests/\w+\.py::\w+", block.not_run)
    files = [f for f in re.findall(r"examples/[\w/]+\.py", block.not_run)]
    assert tests or files, f"{block.where}: the not-run reason names no test and no example file"
    for ref in tests:
        _test_exists(ref)
    for file in files:
        if (ROOT / file).is_file():
            sources = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
            assert Path(file).name in sources, f"{block.where}: no test runs {file}"
        else:
            assert file in PENDING_FILES, f"{block.where}: {file} does not exist"


@pytest.mark.dist
@pytest.mark.parametrize("code", list(TO_RUN), ids=[b.where for b in TO_RUN.values()])
def test_python_block_runs(code: str, tmp_path: Path) -> None:
    block = TO_RUN[code]
    script = tmp_path / "block.py"  # a file: Lightning's launcher re-runs it in the other processes
    script.write_text(code)
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, f"{block.where}:\n{code}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
