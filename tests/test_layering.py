"""The package's modules import each other without cycles (the layers read top-down).

Reads every module's source (no imports run) and collects the package modules it imports at run
time, function-level imports included; imports under ``if TYPE_CHECKING:`` are left out (they
name types for annotations only and never run).
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


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports at run time."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
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
    return {m for m in found if m in modules and m != name}


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


def test_layers() -> None:
    """strategy -> hook -> patterns / compressors / schedules -> memory / stats."""
    graph = _graph()
    assert "lightning_sparse.patterns" in graph["lightning_sparse.hook"]
    assert "lightning_sparse.patterns" in graph["lightning_sparse.schedules"]
    below_hook = ["patterns", "schedules", "fallback", "state", "memory", "stats", "comm", "_utils"]
    for name in below_hook:
        deps = graph[f"lightning_sparse.{name}"]
        assert not {"lightning_sparse.hook", "lightning_sparse.update", "lightning_sparse.strategy"} & deps, name
    for name in ["patterns", "schedules", "fallback"]:
        assert "lightning_sparse.state" not in graph[f"lightning_sparse.{name}"], name
