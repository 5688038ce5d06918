"""The one walk over cache objects: every array they hold, and its bytes.

Per-layer caches (mlx-lm's, mlx-vlm's and ours), their batched forms and
`CacheList` nesting are walked by their attributes, lists and tuples; objects
of other modules are not entered. The same walk serves what a forward must
evaluate, what a snapshot costs in the prefix cache, and what the engine's
caches really hold against the byte budget (rule 9 of docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx

_CACHE_MODULES = ("mlx_lm.models", "mlx_vlm.models", "mlxserve.models")
# Deeper than any cache nesting we build (CacheList in a batch in a list).
_MAX_DEPTH = 8


def cache_arrays(caches: Iterable[Any]) -> list[mx.array]:
    """Every mx.array reachable from these cache objects, each once."""
    seen: dict[int, mx.array] = {}
    stack: list[tuple[Any, int]] = [(c, 0) for c in caches]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, mx.array):
            seen.setdefault(id(item), item)
        elif depth > _MAX_DEPTH:
            continue
        elif isinstance(item, list | tuple):
            stack.extend((x, depth + 1) for x in item)
        elif type(item).__module__.startswith(_CACHE_MODULES) and hasattr(item, "__dict__"):
            stack.extend((x, depth + 1) for x in vars(item).values())
    return list(seen.values())


def cache_nbytes(caches: Iterable[Any]) -> int:
    """Bytes the arrays of these cache objects hold, each array once."""
    return sum(a.nbytes for a in cache_arrays(caches))
