"""Copy and measure per-layer model caches (mlx-lm and mlx-vlm cache classes).

A model's cache is a list with one object per layer. The live objects write
into their buffers in place while a request generates, so a snapshot kept for
reuse must be a real copy. `copy_cache` makes one: new objects of the same
classes holding freshly allocated arrays trimmed to what generation needs (a
KVCache's preallocated step slack is dropped), evaluated now or scheduled.
`share_cache` hands a stored snapshot out without copying: new objects over
the same (immutable) buffers.

Supported classes (`layers.py` describes each once; dispatch is on the exact
class):

- mlx_lm.models.cache: KVCache, QuantizedKVCache, RotatingKVCache,
  ArraysCache, CacheList (nested to any depth)
- mlx_vlm.models.cache: KVCache, QuantizedKVCache, RotatingKVCache,
  ArraysCache, PoolingCache, CacheList (distinct classes from mlx-lm's)
- mlx_lm.models.deepseek_v41: LayerCache; our DeepSeek-V4 CarryingPoolingCache

Anything else raises `UnsupportedCacheError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from mlxserve.cache.arrays import cache_arrays, cache_nbytes
from mlxserve.cache.layers import UnsupportedCacheError, build_layer, kind_of, layer_parts

__all__ = [
    "UnsupportedCacheError",
    "cache_arrays",
    "cache_nbytes",
    "cache_offset",
    "copy_cache",
    "share_cache",
    "is_trimmable",
    "tracked_offset",
    "trim_cache",
    "trim_step",
]


def _copy_array(a: mx.array) -> mx.array:
    """A new array with its own buffer (never a view that shares `a`'s memory).

    `a * 1` is an elementwise op whose output MLX allocates fresh (the input is
    still referenced by the live cache, so its buffer cannot be donated). It
    keeps the dtype, and `-0.0 * 1` stays `-0.0`.
    """
    if a.dtype == mx.bool_:
        return mx.logical_and(a, mx.array(True))
    return a * mx.array(1, dtype=a.dtype)


def _share_array(a: mx.array) -> mx.array:
    """A new handle on `a`'s buffer (no copy).

    MLX arrays are values: a slice assignment through the new handle writes
    into a fresh buffer (a buffer another array still uses is never donated),
    and it rebinds only that handle, so `a` never changes.
    """
    return a.reshape(a.shape)


ArrayFn = Callable[[mx.array], mx.array]


def _copy_one(cache: Any, fn: ArrayFn = _copy_array) -> Any:
    return build_layer(layer_parts(cache).mapped(fn))


def copy_cache(caches: Sequence[Any], wait: bool = True) -> list[Any]:
    """A deep copy of a per-layer cache list with buffers of its own, safe from later writes.

    With `wait`, the copy is evaluated before it returns; without, it is
    scheduled (`mx.async_eval`) and overlaps whatever the caller does next
    (the copy reads the values the arrays hold now, whatever is written later).
    Raises UnsupportedCacheError for a cache class this module does not know.
    """
    copies = [_copy_one(c) for c in caches]
    arrays = cache_arrays(copies)
    if arrays:
        if wait:
            mx.eval(arrays)
        else:
            mx.async_eval(arrays)
    return copies


def share_cache(caches: Sequence[Any]) -> list[Any]:
    """New cache objects over the same buffers: O(layers), no array is copied.

    For handing out a stored snapshot: what the new objects write (in place or
    not) never reaches the snapshot, because every array is a new handle and a
    buffer that another array still holds is copied before MLX writes into it.
    The copy, where the cache type needs one, happens inside the next forward.
    """
    return [_copy_one(c, _share_array) for c in caches]


def is_trimmable(caches: Sequence[Any]) -> bool:
    """True only if every layer can drop its last tokens exactly.

    Plain and quantized KV caches (and CacheLists of only those) can; rotating
    window, pooled, recurrent and DeepSeek-V4.1 layer caches cannot.
    """
    return len(caches) > 0 and all(kind_of(c).trimmable(c) for c in caches)


def trim_step(caches: Sequence[Any]) -> int:
    """A trimmable cache is trimmed back exactly only to a multiple of this many tokens:
    1, or the group size of keys quantized per channel (`models/channel_cache.py`)."""
    return max((kind_of(c).trim_step(c) for c in caches), default=1)


def trim_cache(caches: Sequence[Any], n: int) -> int:
    """Drop the last `n` tokens from every layer in place; return how many were dropped.

    The buffers keep their size until the cache is copied again (`copy_cache`
    keeps only the used rows). Raises ValueError if the cache is not trimmable.
    """
    if n < 0:
        raise ValueError(f"cannot trim a negative number of tokens ({n})")
    if not is_trimmable(caches):
        raise ValueError("cache is not trimmable")
    trimmed = [int(c.trim(n)) for c in caches]
    return trimmed[0]


def tracked_offset(caches: Sequence[Any]) -> int | None:
    """The number of tokens the cache holds, or None if no layer counts tokens.

    Taken from the first layer that tracks it (a recurrent ArraysCache does not).
    """
    for c in caches:
        off = kind_of(c).offset(c)
        if off is not None:
            return off
    return None


def cache_offset(caches: Sequence[Any]) -> int:
    """The number of tokens the cache holds, from the first layer that counts them.

    0 for an empty list. Raises UnsupportedCacheError if no layer tracks a
    token count (e.g. only recurrent ArraysCache layers).
    """
    off = tracked_offset(caches)
    if off is not None:
        return off
    if caches:
        raise UnsupportedCacheError(caches[0], "no layer tracks a token offset")
    return 0
