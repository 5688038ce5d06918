"""The exact versions of mlx, mlx-lm and mlx-vlm that mlxserve was written and tested against.

mlxserve wraps a few of their internals (cache classes taken apart and built
back, DeepSeek-V4's compressor, mlx-lm's
`models.base.quantized_scaled_dot_product_attention` for the 4-bit KV cache), so
another version may change what those wrappers rely on. pyproject.toml pins
these; `mlxserve serve` checks them at start and refuses to run with others (a
clear error, not a wrong token).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

PINNED = {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-vlm": "0.7.10"}


def version_problems() -> list[str]:
    """One line per dependency that is missing or not its pinned version."""
    problems = []
    for package, wanted in PINNED.items():
        try:
            found = version(package)
        except PackageNotFoundError:
            found = None
        if found != wanted:
            problems.append(f"{package} {found or 'is not installed'} (mlxserve needs {wanted})")
    return problems


def check_versions() -> None:
    """Raise RuntimeError naming each dependency at another version than pinned."""
    problems = version_problems()
    if problems:
        raise RuntimeError(
            "mlxserve was tested against other dependency versions: "
            + "; ".join(problems)
            + ". Reinstall mlxserve (pip install -e .) to get them."
        )
