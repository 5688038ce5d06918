"""Benchmark output: `key=value` lines on stdout and a JSON file."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("bench-results")


def emit(name: str, figures: dict[str, Any], json_path: str | Path | None = None) -> Path:
    """Print each figure as `key=value` and write them all, with context, to JSON."""
    for key, value in figures.items():
        if isinstance(value, float):
            print(f"{key}={value:.6g}")
        elif isinstance(value, (dict, list)):
            print(f"{key}={json.dumps(value, separators=(',', ':'))}")
        else:
            print(f"{key}={value}")
    path = Path(json_path) if json_path else DEFAULT_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": platform.platform(),
        "figures": figures,
    }
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"json={path}")
    return path
