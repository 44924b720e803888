"""The package's shape, checked: the import graph of dbt_ivm and the adapter
(every import: module level, inside functions and under TYPE_CHECKING) has no
cycle, between modules or between packages; no module is over MAX_LINES; no
class has more than MAX_METHODS methods. Read from the source with ``ast``,
nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dbt_ivm", "dbt/adapters/spark_ivm")
MAX_LINES = 550
MAX_METHODS = 25


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict) -> str | None:
    """The project module an imported name lives in (``a.b.c`` -> ``a.b`` when
    ``c`` is a name in it), or None outside the project."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        for n in names:
            target = _resolve(n, modules)
            if target is not None and target != module:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _package(module: str) -> str:
    """A module's package: the folder it is in (a package's __init__ is its own)."""
    path = _modules()[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def test_the_graph_is_read():
    g = graph()
    assert "dbt_ivm.refresh" in g and "dbt_ivm.plan" in g["dbt_ivm.explain"]


def test_no_import_cycle_between_modules():
    cycle = _cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for m, targets in graph().items():
        for t in targets:
            a, b = _package(m), _package(t)
            # a package's own modules and its parent's __init__ are one room
            if a != b and not a.startswith(b + ".") and not b.startswith(a + "."):
                edges.setdefault(a, set()).add(b)
    cycle = _cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", sorted(_modules()))
def test_module_size(module):
    lines = len(_modules()[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES}): split it by topic"


def test_class_size():
    big = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > MAX_METHODS:
                    big.append(f"{module}.{node.name}: {len(methods)} methods")
    assert big == [], big
