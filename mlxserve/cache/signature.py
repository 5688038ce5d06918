"""A model's signature: what a stored cache entry must match to be reused.

Two checkpoints give the same cache for the same tokens only if they are the
same model, so the signature covers the config, a fingerprint of the weights
(each weight file's name, size, safetensors header, and samples of its bytes,
so two fine-tunes of one architecture differ), the cache layout (each layer's
cache class and settings), the library versions that compute the cache, and
the disk format's version, and a quantized cache's bits and group size.
Anything in doubt makes another signature: a miss,
never a wrong token.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from mlxserve.cache.codec import cache_layout
from mlxserve.cache.disk_file import FORMAT_VERSION
from mlxserve.kv_quant import KVQuant

__all__ = ["model_signature"]

_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf")
_SAMPLES = 16
_SAMPLE_BYTES = 4096
_MAX_HEADER = 64 * 1024 * 1024


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def _file_fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        start = 0
        if path.suffix == ".safetensors" and size >= 8:
            (length,) = struct.unpack("<Q", f.read(8))
            length = min(length, _MAX_HEADER, size - 8)
            digest.update(f.read(length))
            start = 8 + length
        span = max(0, size - start - _SAMPLE_BYTES)
        for i in range(_SAMPLES + 1):
            f.seek(start + span * i // _SAMPLES)
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def weights_fingerprint(model_dir: Path) -> dict[str, str]:
    """Each weight file's fingerprint, by name."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    return {p.name: _file_fingerprint(p) for p in files}


def model_signature(
    model_dir: Path,
    config: dict[str, Any],
    fresh_cache: Sequence[Any],
    kv_quant: KVQuant | None = None,
) -> str:
    """A hex digest standing for everything a stored cache depends on.

    `kv_quant` (a quantized cache's bits, group size and full-precision head) is
    named on its own: with `quantize_after` a fresh cache is still full precision."""
    described = {
        "kv_quant": None if kv_quant is None else kv_quant.described(),
        "format": FORMAT_VERSION,
        "config": config,
        "weights": weights_fingerprint(model_dir),
        "cache": cache_layout(fresh_cache),
        "versions": {p: _version(p) for p in ("mlx", "mlx-lm", "mlx-vlm", "mlxserve")},
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
