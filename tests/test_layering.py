"""The package's modules import each other without cycles (the layers read top-down).

Reads every module's source (no imports run) and collects the package modules it imports,
function-level imports and imports under ``if TYPE_CHECKING:`` included: a type named from a
module above is a dependency on it too, and the package has none in a circle. Importing a module of
a sub-package runs that sub-package's ``__init__.py`` first, so it counts as importing it too.
The package root holds only ``__init__.py``, ``config.py``, ``_utils.py`` and the sub-packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_sparse

PACKAGE = Path(lightning_sparse.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports (for type checkers too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    # importing `lightning_sparse.sub.module` runs `lightning_sparse/sub/__init__.py` first (the root's
    # `__init__` is left out: every module is inside it)
    found |= {parent for m in found for parent in _parents(m) if not name.startswith(parent + ".")}
    return {m for m in found if m in modules and m != name}


def _parents(module: str) -> list[str]:
    """The packages above ``module`` inside the package, the root left out."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := walk(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)) is not None:
            return found
    return None


def test_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_package_modules_import_without_cycles() -> None:
    graph = _graph()
    # parent packages are imported by their submodules' imports anyway: leave those edges out
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    assert _cycle(graph) is None


def test_type_checking_imports_count() -> None:
    path = PACKAGE / "_probe_for_layering_test.py"
    try:
        path.write_text(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_sparse.exchange.state import X\n"
        )
        assert "lightning_sparse.exchange.state" in _imports(path, {"lightning_sparse.exchange.state"})
    finally:
        path.unlink()


def _deps(graph: dict[str, set[str]], module: str) -> set[str]:
    """Everything ``module`` depends on, directly or not."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen and not module.startswith(nxt + "."):
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_imports_of_a_submodule_count_for_its_packages() -> None:
    path = PACKAGE / "_probe_for_layering_test.py"
    modules = {"lightning_sparse.exchange", "lightning_sparse.exchange.state", "lightning_sparse.wire"}
    try:
        path.write_text("from lightning_sparse.exchange.state import X\n")
        assert _imports(path, modules) == {"lightning_sparse.exchange", "lightning_sparse.exchange.state"}
    finally:
        path.unlink()
    # a module of a sub-package does not count that sub-package's own __init__
    assert _imports(PACKAGE / "exchange" / "step.py", modules) == {
        "lightning_sparse.exchange.state",
        "lightning_sparse.wire",
    }


def test_layers() -> None:
    """shells (strategies.ddp, fabric) -> strategies.core, strategies.shell -> strategies.checkpoint,
    strategies.advice, strategies.ddp_args -> exchange.update, exchange.hook -> exchange.outer,
    exchange.step -> exchange.state -> config -> schedules, exchange.fallback -> wire -> compressors,
    wire.memory, wire.stats, _utils. No module reaches a layer above its own."""
    graph = _graph()
    pkg = "lightning_sparse."
    step, state, hook, update = (pkg + "exchange." + n for n in ("step", "state", "hook", "update"))
    outer, fallback = pkg + "exchange.outer", pkg + "exchange.fallback"
    core, shell, checkpoint = (pkg + "strategies." + n for n in ("core", "shell", "checkpoint"))
    strategy = pkg + "strategies.ddp"
    fabric = {m for m in graph if m == pkg + "fabric" or m.startswith(pkg + "fabric.")}
    assert pkg + "wire" in graph[step] and pkg + "wire" in _deps(graph, pkg + "schedules")
    wire = [m for m in graph if m.startswith(pkg + "wire")]
    assert len(wire) >= 7
    above_wire = {state, pkg + "config", pkg + "schedules", fallback, hook, outer, update, core}
    above_wire |= {step, checkpoint, shell, strategy, *fabric}
    for module in wire:
        assert not _deps(graph, module) & above_wire, module
    for name in [pkg + "schedules", fallback]:
        assert not _deps(graph, name) & {state, pkg + "config", hook, step}, name
    assert not _deps(graph, pkg + "config") & {state, hook, update, core}
    # the state owns the rank's exchange; the step's exchange of a bucket works on it, below DDP's hook and
    # update mode
    assert not _deps(graph, step) & {hook, update, core}
    assert not _deps(graph, state) & {step, hook, update, core}
    for name in [hook, outer]:
        assert not _deps(graph, name) & {update, core, strategy, *fabric}, name
    # update mode drives the exchange itself: nothing of it goes through DDP's hook module
    assert hook not in _deps(graph, update)
    for name in [update, checkpoint, pkg + "strategies.advice", pkg + "strategies.ddp_args"]:
        assert not _deps(graph, name) & {core, shell, strategy, *fabric}, name
    assert not _deps(graph, core) & {strategy, *fabric}


def test_sub_packages_read_top_down() -> None:
    """fabric -> strategies -> exchange, telemetry, config, schedules, wire, compressors: nothing below
    the front ends reaches them, and the Trainer's side never reaches Fabric's."""
    graph = _graph()
    pkg = "lightning_sparse."

    def reached(top: str) -> set[str]:
        found: set[str] = set()
        for module in graph:
            if module == pkg + top or module.startswith(pkg + top + "."):
                found |= {m.split(".")[1] for m in _deps(graph, module) if m != "lightning_sparse"}
        return found

    for below in ["exchange", "telemetry", "wire", "compressors", "schedules", "config", "_utils"]:
        assert not reached(below) & {"strategies", "fabric"}, below
    assert "fabric" not in reached("strategies")


#: where a module goes (docs/development.md, "The shape of the package", says what each holds)
SUB_PACKAGES = (
    "strategies/ (the Trainer strategies and what both front ends share), fabric/ (the Fabric strategies), "
    "exchange/ (the state, the step's exchange, DDP's hooks, update mode), telemetry/ (counters, metrics, the "
    "summary, the monitor, the cost model), wire/, compressors/, schedules/, demos/"
)


def test_the_root_holds_only_the_package_modules_and_sub_packages() -> None:
    allowed = {"__init__.py", "config.py", "_utils.py"}
    stray = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in allowed)
    assert not stray, (
        f"{stray} at the package root: it holds only {sorted(allowed)} and sub-packages; "
        f"a module goes into the sub-package of its layer: {SUB_PACKAGES}"
    )
    folders = [p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert not [p.name for p in folders if not (p / "__init__.py").is_file()], "every folder is a sub-package"
    assert {"strategies", "fabric", "exchange", "telemetry"} <= {p.name for p in folders}


def test_each_module_says_its_one_job() -> None:
    """Every module opens with a docstring whose first line is one sentence naming what it is for."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        first = (doc or "").split("\n", 1)[0]
        if not first.strip() or not first.rstrip().endswith("."):
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, missing


def test_no_module_over_400_lines() -> None:
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = {name: n for name, n in sizes.items() if n > 400}
    assert not long, long


#: the package's three sides, bottom up; a sub-package holds modules of one side only
SIDES = {
    "core": ("wire", "compressors", "_utils"),
    "algorithms": ("exchange", "schedules", "telemetry", "config"),
    "lightning": ("strategies", "fabric", "demos"),
}


def _side(module: str) -> str | None:
    part = module.split(".")[1] if module.count(".") else None
    return next((side for side, parts in SIDES.items() if part in parts), None)


def _imports_lightning(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
    return any(name == "lightning" or name.startswith("lightning.") for name in names)


def test_each_side_imports_only_the_sides_below_it_and_only_the_top_imports_lightning() -> None:
    """The core (the wire, the compressors) and the algorithms (update mode's fragments, the gradient hook, outer
    steps, fault tolerance, BatchNorm statistics, schedules, telemetry, the settings) import no Lightning; the
    core imports nothing of the algorithms; the Lightning front ends, callbacks and demos sit on top."""
    graph = _graph()
    order = list(SIDES)
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        side = _side(module)
        if side is None:
            continue  # the package's __init__, which registers the strategies
        assert side == "lightning" or not _imports_lightning(path), f"{module} imports Lightning"
        for dep in graph[module]:
            dep_side = _side(dep)
            assert dep_side is None or order.index(dep_side) <= order.index(side), f"{module} -> {dep}"
