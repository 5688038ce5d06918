"""Copy and measure per-layer model caches (mlx-lm and mlx-vlm cache classes).

A model's cache is a list with one object per layer. The live objects write
into their buffers in place while a request generates, so a snapshot kept for
reuse must be a real copy. `copy_cache` makes one: new objects of the same
classes holding freshly allocated arrays trimmed to what generation needs (a
KVCache's preallocated step slack is dropped), evaluated now or scheduled.
`share_cache` hands a stored snapshot out without copying: new objects over
the same (immutable) buffers.

Supported classes (dispatch is on the exact class; a subclass may hold extra
state, so it is refused rather than guessed at):

- mlx_lm.models.cache: KVCache, QuantizedKVCache, RotatingKVCache,
  ArraysCache, CacheList (nested to any depth)
- mlx_vlm.models.cache: KVCache, QuantizedKVCache, RotatingKVCache,
  ArraysCache, PoolingCache, CacheList (distinct classes from mlx-lm's)
- mlx_lm.models.deepseek_v41: LayerCache

Anything else raises `UnsupportedCacheError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as lm_cache
import mlx_lm.models.deepseek_v41 as lm_v41
import mlx_vlm.models.cache as vlm_cache

__all__ = [
    "UnsupportedCacheError",
    "cache_nbytes",
    "cache_offset",
    "copy_cache",
    "share_cache",
    "is_trimmable",
    "tracked_offset",
    "trim_cache",
]


class UnsupportedCacheError(TypeError):
    """A cache object of a class this module does not know how to copy or measure."""

    def __init__(self, cache: Any, reason: str = "") -> None:
        cls = type(cache)
        name = f"{cls.__module__}.{cls.__qualname__}"
        detail = f": {reason}" if reason else ""
        super().__init__(f"unsupported cache type {name}{detail}")
        self.cache_type = cls


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


def _copy_opt(a: mx.array | None, fn: ArrayFn) -> mx.array | None:
    return None if a is None else fn(a)


def _rows(a: mx.array | None, n: int, fn: ArrayFn) -> mx.array | None:
    """The first `n` rows along the sequence axis (-2) of a KV buffer, through `fn`."""
    if a is None:
        return None
    return fn(a[..., :n, :] if a.shape[-2] != n else a)


@dataclass(frozen=True)
class _Kind:
    """How to handle one cache class."""

    copy: Callable[[Any, ArrayFn], Any]
    arrays: Callable[[Any], Iterator[mx.array]]
    offset: Callable[[Any], int | None]
    trimmable: Callable[[Any], bool]


def _present(*arrays: Any) -> Iterator[mx.array]:
    for a in arrays:
        if isinstance(a, mx.array):
            yield a
        elif isinstance(a, tuple | list):
            yield from _present(*a)


def _never(_: Any) -> bool:
    return False


def _always(_: Any) -> bool:
    return True


def _attr_offset(c: Any) -> int | None:
    return int(c.offset)


def _no_offset(_: Any) -> int | None:
    return None


def _kv_arrays(c: Any) -> Iterator[mx.array]:
    return _present(c.keys, c.values)


# --- KVCache -----------------------------------------------------------------


def _copy_lm_kv(c: lm_cache.KVCache, fn: ArrayFn) -> lm_cache.KVCache:
    new = lm_cache.KVCache()
    if c.keys is not None:
        new.state = (_rows(c.keys, c.offset, fn), _rows(c.values, c.offset, fn), c.offset)
    return new


def _copy_vlm_kv(c: vlm_cache.KVCache, fn: ArrayFn) -> vlm_cache.KVCache:
    new = vlm_cache.KVCache()
    if c.keys is not None:
        # The setter takes the offset from the keys' length.
        new.state = (_rows(c.keys, c.offset, fn), _rows(c.values, c.offset, fn))
    return new


# --- QuantizedKVCache ----------------------------------------------------------


def _quant_rows(parts: Sequence[mx.array], n: int, fn: ArrayFn) -> tuple[mx.array, ...]:
    return tuple(fn(p[..., :n, :]) for p in parts)


def _copy_lm_quant(c: lm_cache.QuantizedKVCache, fn: ArrayFn) -> lm_cache.QuantizedKVCache:
    new = lm_cache.QuantizedKVCache(group_size=c.group_size, bits=c.bits)
    if c.keys is not None:
        keys, values = _quant_rows(c.keys, c.offset, fn), _quant_rows(c.values, c.offset, fn)
        new.state = (keys, values, c.offset, c.group_size, c.bits)
    return new


def _copy_vlm_quant(c: vlm_cache.QuantizedKVCache, fn: ArrayFn) -> vlm_cache.QuantizedKVCache:
    new = vlm_cache.QuantizedKVCache(group_size=c.group_size, bits=c.bits)
    if c.keys is not None:
        new.state = (_quant_rows(c.keys, c.offset, fn), _quant_rows(c.values, c.offset, fn))
        new.meta_state = c.meta_state
    return new


# --- RotatingKVCache -----------------------------------------------------------


def _rotating_rows(keys: mx.array, offset: int, idx: int) -> int:
    """How many buffer rows a rotating cache needs to continue identically.

    Before the buffer first fills, rows past the write index are unused
    preallocation and are dropped; once it has wrapped (or was trimmed by
    a multi-token update) the whole buffer is live.
    """
    size = int(keys.shape[2])
    if offset < size and idx == offset:
        return offset
    return size


def _copy_lm_rotating(c: lm_cache.RotatingKVCache, fn: ArrayFn) -> lm_cache.RotatingKVCache:
    new = lm_cache.RotatingKVCache(max_size=c.max_size, keep=c.keep)
    if c.keys is not None:
        keys, values, offset, keep, max_size, idx = c.state
        n = _rotating_rows(keys, offset, idx)
        new.state = (_rows(keys, n, fn), _rows(values, n, fn), offset, keep, max_size, idx)
    return new


def _copy_vlm_rotating(c: vlm_cache.RotatingKVCache, fn: ArrayFn) -> vlm_cache.RotatingKVCache:
    new = vlm_cache.RotatingKVCache(max_size=c.max_size, keep=c.keep)
    if c.keys is not None:
        # The state getter already drops unused rows before the first wrap;
        # meta_state carries keep, max_size, offset and the write index.
        _, _, offset, idx = (int(v) for v in c.meta_state)
        n = _rotating_rows(c.keys, offset, idx)
        new.state = (_rows(c.keys, n, fn), _rows(c.values, n, fn))
        new.meta_state = c.meta_state
    return new


# --- ArraysCache (recurrent / conv state) ----------------------------------------


def _copy_lm_arrays(c: lm_cache.ArraysCache, fn: ArrayFn) -> lm_cache.ArraysCache:
    new = lm_cache.ArraysCache(len(c.cache))
    new.state = (
        [_copy_opt(a, fn) for a in c.cache],
        _copy_opt(c.left_padding, fn),
        _copy_opt(c.lengths, fn),
    )
    return new


def _copy_vlm_arrays(c: vlm_cache.ArraysCache, fn: ArrayFn) -> vlm_cache.ArraysCache:
    if c.is_speculating:
        raise UnsupportedCacheError(c, "cannot snapshot during a speculative block")
    new = vlm_cache.ArraysCache(len(c.cache))
    new.state = [_copy_opt(a, fn) for a in c.cache]
    new.left_padding = _copy_opt(c.left_padding, fn)
    new.lengths = _copy_opt(c.lengths, fn)
    return new


def _arrays_cache_arrays(c: Any) -> Iterator[mx.array]:
    return _present(c.cache, c.left_padding, c.lengths)


# --- PoolingCache (mlx-vlm DeepSeek-V4 compressed KV) ----------------------------


def _copy_pooling(c: vlm_cache.PoolingCache, fn: ArrayFn) -> vlm_cache.PoolingCache:
    if c.is_speculating:
        raise UnsupportedCacheError(c, "cannot snapshot during a speculative block")
    new: Any = vlm_cache.PoolingCache(c.ratio)
    # The remainder buffers are written in place one row at a time up to
    # `ratio` rows, so they keep their full (small) size.
    new.buf_kv = _copy_opt(c.buf_kv, fn)
    new.buf_gate = _copy_opt(c.buf_gate, fn)
    new.pooled = _copy_opt(c.pooled, fn)
    new.remainder = c.remainder
    return new


def _pooling_arrays(c: Any) -> Iterator[mx.array]:
    return _present(c.buf_kv, c.buf_gate, c.pooled)


def _copy_carrying_pooling(c: Any, fn: ArrayFn) -> Any:
    from mlxserve.models.dsv4_overlap import CarryingPoolingCache

    base = _copy_pooling(c, fn)
    new = CarryingPoolingCache(c.ratio)
    new.buf_kv, new.buf_gate, new.pooled = base.buf_kv, base.buf_gate, base.pooled
    new.remainder = base.remainder
    new.carry_kv = _copy_opt(c.carry_kv, fn)
    new.carry_gate = _copy_opt(c.carry_gate, fn)
    return new


def _carrying_pooling_arrays(c: Any) -> Iterator[mx.array]:
    return _present(c.buf_kv, c.buf_gate, c.pooled, c.carry_kv, c.carry_gate)


def _pooling_offset(c: Any) -> int | None:
    # Tokens seen: each pooled row stands for `ratio` tokens, plus the open group.
    return int(c.offset) * int(c.ratio) + int(c.remainder)


# --- DeepSeek-V4.1 LayerCache ------------------------------------------------------

_LAYER_FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")


def _copy_v41_layer(c: lm_v41.LayerCache, fn: ArrayFn) -> lm_v41.LayerCache:
    # LayerCache has a state getter but no setter; its fields are public.
    new = lm_v41.LayerCache(c.window_size)
    new.offset = c.offset
    for name in _LAYER_FIELDS:
        setattr(new, name, _copy_opt(getattr(c, name), fn))
    return new


def _v41_arrays(c: Any) -> Iterator[mx.array]:
    return _present(*(getattr(c, name) for name in _LAYER_FIELDS))


# --- CacheList (recursive) ---------------------------------------------------------


def _copy_cache_list(c: Any, fn: ArrayFn) -> Any:
    return type(c)(*(_copy_one(sub, fn) for sub in c.caches))


def _cache_list_arrays(c: Any) -> Iterator[mx.array]:
    for sub in c.caches:
        yield from _kind(sub).arrays(sub)


def _cache_list_offset(c: Any) -> int | None:
    for sub in c.caches:
        off = _kind(sub).offset(sub)
        if off is not None:
            return off
    return None


def _cache_list_trimmable(c: Any) -> bool:
    return len(c.caches) > 0 and all(_kind(sub).trimmable(sub) for sub in c.caches)


@functools.cache
def _registry() -> dict[type, _Kind]:
    from mlxserve.models.dsv4_overlap import CarryingPoolingCache

    def kv(copier: Callable[[Any, ArrayFn], Any], trimmable: Callable[[Any], bool]) -> _Kind:
        return _Kind(copier, _kv_arrays, _attr_offset, trimmable)

    def arrays_cache(copier: Callable[[Any, ArrayFn], Any]) -> _Kind:
        return _Kind(copier, _arrays_cache_arrays, _no_offset, _never)

    cache_list = _Kind(
        _copy_cache_list, _cache_list_arrays, _cache_list_offset, _cache_list_trimmable
    )
    return {
        lm_cache.KVCache: kv(_copy_lm_kv, _always),
        vlm_cache.KVCache: kv(_copy_vlm_kv, _always),
        lm_cache.QuantizedKVCache: kv(_copy_lm_quant, _always),
        vlm_cache.QuantizedKVCache: kv(_copy_vlm_quant, _always),
        # mlx-lm calls a rotating cache trimmable until it first fills; we never
        # do, so a window cache never gets a `prompt + output` entry.
        lm_cache.RotatingKVCache: kv(_copy_lm_rotating, _never),
        vlm_cache.RotatingKVCache: kv(_copy_vlm_rotating, _never),
        lm_cache.ArraysCache: arrays_cache(_copy_lm_arrays),
        vlm_cache.ArraysCache: arrays_cache(_copy_vlm_arrays),
        vlm_cache.PoolingCache: _Kind(_copy_pooling, _pooling_arrays, _pooling_offset, _never),
        CarryingPoolingCache: _Kind(
            _copy_carrying_pooling, _carrying_pooling_arrays, _pooling_offset, _never
        ),
        lm_v41.LayerCache: _Kind(_copy_v41_layer, _v41_arrays, _attr_offset, _never),
        lm_cache.CacheList: cache_list,
        vlm_cache.CacheList: cache_list,
    }


def _kind(cache: Any) -> _Kind:
    kind = _registry().get(type(cache))
    if kind is None:
        raise UnsupportedCacheError(cache)
    return kind


def _copy_one(cache: Any, fn: ArrayFn = _copy_array) -> Any:
    return _kind(cache).copy(cache, fn)


def _unique_arrays(caches: Sequence[Any]) -> list[mx.array]:
    seen: dict[int, mx.array] = {}
    for c in caches:
        for a in _kind(c).arrays(c):
            seen.setdefault(id(a), a)
    return list(seen.values())


def cache_arrays(caches: Sequence[Any]) -> list[mx.array]:
    """Every array a per-layer cache list holds, each once: what a forward must
    evaluate to have fed its tokens into the cache.

    Raises UnsupportedCacheError for a cache class this module does not know.
    """
    return _unique_arrays(caches)


def copy_cache(caches: Sequence[Any], wait: bool = True) -> list[Any]:
    """A deep copy of a per-layer cache list with buffers of its own, safe from later writes.

    With `wait`, the copy is evaluated before it returns; without, it is
    scheduled (`mx.async_eval`) and overlaps whatever the caller does next
    (the copy reads the values the arrays hold now, whatever is written later).
    Raises UnsupportedCacheError for a cache class this module does not know.
    """
    copies = [_copy_one(c) for c in caches]
    arrays = _unique_arrays(copies)
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


def cache_nbytes(caches: Sequence[Any]) -> int:
    """Bytes held by the arrays of a per-layer cache list (nested lists walked).

    Each array counts once even if several fields refer to it.
    """
    return sum(a.nbytes for a in _unique_arrays(caches))


def is_trimmable(caches: Sequence[Any]) -> bool:
    """True only if every layer can drop its last tokens exactly.

    Plain and quantized KV caches (and CacheLists of only those) can; rotating
    window, pooled, recurrent and DeepSeek-V4.1 layer caches cannot.
    """
    return len(caches) > 0 and all(_kind(c).trimmable(c) for c in caches)


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
        off = _kind(c).offset(c)
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
