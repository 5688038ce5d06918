"""The package's imports form no circle: every module of mlxserve, every import
(module level, inside functions, or for typing only) is an edge."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

import mlxserve

PACKAGE_ROOT = Path(mlxserve.__file__).parent


def module_files(root: Path) -> dict[str, Path]:
    files = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def _imported_names(tree: ast.AST, package: str) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == package:
                yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == package)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name is resolved to the
    longest module path it starts with: `from a.b import c` is a.b.c if that is
    a module, else a.b)."""
    files = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for imported in _imported_names(ast.parse(path.read_text()), root.name):
            target = imported
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def test_mlxserve_imports_have_no_cycle() -> None:
    graph = import_graph(PACKAGE_ROOT)
    assert len(graph) > 100
    assert cycles(graph) == []


def test_a_cycle_through_a_typing_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pool.py").write_text("from pkg.budget import default_budget\n")
    (package / "budget.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "def default_budget() -> int:\n    return 1\n"
        "if TYPE_CHECKING:\n    from pkg.pool import Pool\n"
    )
    (package / "leaf.py").write_text("def helper() -> None:\n    from pkg import pool\n")
    assert cycles(import_graph(package)) == [["pkg.budget", "pkg.pool"]]


def test_engine_and_models_are_grouped_by_concern() -> None:
    for folder in ("engine/spec", "engine/distributed", "models/deepseek_v4", "models/tiny"):
        assert (PACKAGE_ROOT / folder / "__init__.py").is_file(), folder


@pytest.mark.parametrize("name", sorted(module_files(PACKAGE_ROOT)))
def test_every_module_imports(name: str) -> None:
    importlib.import_module(name)
