"""The rules the code cites are the repository's own (docs/architecture.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _stated_rules() -> set[int]:
    rules = ARCHITECTURE.read_text(encoding="utf-8").split("## Rules", 1)[1]
    return {int(n) for n in re.findall(r"^(\d+)\. \*\*", rules, flags=re.MULTILINE)}


def _cited_rules(text: str) -> set[int]:
    cited: set[int] = set()
    for match in re.finditer(r"\brules? (\d+(?:(?:, | and |-)\d+)*)", text):
        numbers = [int(n) for n in re.findall(r"\d+", match.group(1))]
        if "-" in match.group(1):
            numbers = list(range(numbers[0], numbers[-1] + 1))
        cited.update(numbers)
    return cited


def test_every_rule_the_code_cites_is_stated() -> None:
    stated = _stated_rules()
    assert stated == set(range(1, len(stated) + 1)), "rules are numbered 1..N"
    for path in sorted((ROOT / "mlxserve").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "architecture.md" not in text:
            continue
        missing = _cited_rules(text) - stated
        assert not missing, f"{path.relative_to(ROOT)} cites rules {missing}"


def test_nothing_points_at_a_design_file_outside_the_repository() -> None:
    for folder in ("mlxserve", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md", ".html", ".js", ".css"):
                assert "DESIGN" not in path.read_text(encoding="utf-8"), path
