"""The layering rules, read from the source: who may import whom.

- No dialect folder under `api/` imports another dialect.
- `models/` does not import `chat/`; `engine/` does not import `api/`.
- No private name of mlx, mlx-lm or mlx-vlm is imported.
- Only `engine/runner.py` touches a Runner's private members.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import mlxserve

PACKAGE = Path(mlxserve.__file__).parent
DIALECTS = ("openai", "anthropic", "responses")
DEPENDENCIES = ("mlx", "mlx_lm", "mlx_vlm")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imports(path: Path) -> Iterator[tuple[str, list[str]]]:
    """(module, names) for every import in `path` (names empty for `import x`)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            yield node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


def _part(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_there_are_modules_to_check() -> None:
    parts = {_part(p) for p in _modules()}
    assert {f"api/{d}/routes.py" for d in DIALECTS} <= parts


@pytest.mark.parametrize("dialect", DIALECTS)
def test_no_dialect_imports_another(dialect: str) -> None:
    others = [d for d in DIALECTS if d != dialect]
    for path in (PACKAGE / "api" / dialect).glob("*.py"):
        for module, _ in _imports(path):
            for other in others:
                assert not module.startswith(f"mlxserve.api.{other}"), (_part(path), module)


@pytest.mark.parametrize(("layer", "forbidden"), [("models", "chat"), ("engine", "api")])
def test_lower_layers_do_not_import_upper_ones(layer: str, forbidden: str) -> None:
    for path in (PACKAGE / layer).rglob("*.py"):
        for module, _ in _imports(path):
            assert not module.startswith(f"mlxserve.{forbidden}"), (_part(path), module)


def test_no_private_names_of_dependencies_are_imported() -> None:
    for path in _modules():
        for module, names in _imports(path):
            if module.split(".")[0] not in DEPENDENCIES:
                continue
            private = [p for p in module.split(".") if p.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            assert not private, (_part(path), module, private)


def test_only_the_runner_touches_its_private_members() -> None:
    pattern = re.compile(r"\brunner\._[a-z]")
    for path in _modules():
        if _part(path) == "engine/runner.py":
            continue
        hits = [line for line in path.read_text().splitlines() if pattern.search(line)]
        assert not hits, (_part(path), hits)
