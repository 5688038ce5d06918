"""Each supported cache class, taken apart into plain parts and built back.

A layer's `LayerParts` are its class tag, its integer settings (offsets,
window sizes, quantisation) and its arrays by field name, with sub-caches for
a `CacheList`. Copying a cache (`snapshot.copy_cache`), handing a snapshot out
(`snapshot.share_cache`) and storing one on disk (`codec.py`) all go through
the same two functions per class, so a class is described once.

`parts` may slice (a KV buffer's preallocated rows past its offset are
dropped); the slices are lazy until whoever takes the parts evaluates them.
Dispatch is on the exact class: a subclass may hold extra state, so it is
refused rather than guessed at.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as lm_cache
import mlx_lm.models.deepseek_v41 as lm_v41
import mlx_vlm.models.cache as vlm_cache

__all__ = [
    "Kind",
    "LayerParts",
    "UnsupportedCacheError",
    "build_layer",
    "kind_of",
    "layer_parts",
    "layout_trimmable",
]


class UnsupportedCacheError(TypeError):
    """A cache object of a class this module does not know how to copy or measure."""

    def __init__(self, cache: Any, reason: str = "") -> None:
        cls = type(cache)
        name = f"{cls.__module__}.{cls.__qualname__}"
        detail = f": {reason}" if reason else ""
        super().__init__(f"unsupported cache type {name}{detail}")
        self.cache_type = cls


@dataclass
class LayerParts:
    """One cache object as plain parts: enough to build an identical one."""

    tag: str
    meta: dict[str, int] = field(default_factory=dict)
    arrays: dict[str, mx.array | None] = field(default_factory=dict)
    children: list[LayerParts] = field(default_factory=list)

    def mapped(self, fn: Callable[[mx.array], mx.array]) -> LayerParts:
        """The same parts with `fn` applied to every array (None stays None)."""
        arrays = {k: None if a is None else fn(a) for k, a in self.arrays.items()}
        children = [child.mapped(fn) for child in self.children]
        return LayerParts(self.tag, dict(self.meta), arrays, children)


@dataclass(frozen=True)
class Kind:
    """How to handle one cache class."""

    tag: str
    parts: Callable[[Any], LayerParts]
    build: Callable[[LayerParts], Any]
    offset: Callable[[Any], int | None]
    trimmable: Callable[[Any], bool]
    # Trimmed only back to a multiple of this many positions (a prefix-cache entry).
    trim_step: Callable[[Any], int] = lambda _: 1


def _never(_: Any) -> bool:
    return False


def _always(_: Any) -> bool:
    return True


def _attr_offset(c: Any) -> int | None:
    return int(c.offset)


def _no_offset(_: Any) -> int | None:
    return None


def _rows(a: mx.array, n: int) -> mx.array:
    """The first `n` rows along the sequence axis (-2) of a KV buffer."""
    return a[..., :n, :] if a.shape[-2] != n else a


def _kv_parts(tag: str, keys: Any, values: Any, rows: int, meta: dict[str, int]) -> LayerParts:
    if keys is None:
        return LayerParts(tag, meta)
    arrays: dict[str, mx.array | None] = {"keys": _rows(keys, rows), "values": _rows(values, rows)}
    return LayerParts(tag, meta, arrays)


def _kv_pair(p: LayerParts) -> tuple[mx.array, mx.array] | None:
    keys, values = p.arrays.get("keys"), p.arrays.get("values")
    if keys is None or values is None:
        return None
    return keys, values


# --- KVCache -----------------------------------------------------------------


def _lm_kv_parts(c: lm_cache.KVCache) -> LayerParts:
    return _kv_parts("mlx_lm.KVCache", c.keys, c.values, c.offset, {"offset": int(c.offset)})


def _lm_kv_build(p: LayerParts) -> lm_cache.KVCache:
    new = lm_cache.KVCache()
    pair = _kv_pair(p)
    if pair is not None:
        new.state = (*pair, p.meta["offset"])
    return new


def _vlm_kv_parts(c: vlm_cache.KVCache) -> LayerParts:
    return _kv_parts("mlx_vlm.KVCache", c.keys, c.values, c.offset, {"offset": int(c.offset)})


def _vlm_kv_build(p: LayerParts) -> vlm_cache.KVCache:
    new = vlm_cache.KVCache()
    pair = _kv_pair(p)
    if pair is not None:
        new.state = pair  # the setter takes the offset from the keys' length
    return new


# --- QuantizedKVCache ----------------------------------------------------------


def _quant_parts(tag: str, c: Any) -> LayerParts:
    meta = {"offset": int(c.offset), "group_size": int(c.group_size), "bits": int(c.bits)}
    if c.keys is None:
        return LayerParts(tag, meta)
    meta["pieces"] = len(c.keys)
    arrays: dict[str, mx.array | None] = {}
    for name, pieces in (("keys", c.keys), ("values", c.values)):
        for i, piece in enumerate(pieces):
            arrays[f"{name}.{i}"] = _rows(piece, c.offset)
    return LayerParts(tag, meta, arrays)


def _quant_pieces(p: LayerParts, name: str) -> tuple[Any, ...]:
    return tuple(p.arrays[f"{name}.{i}"] for i in range(p.meta["pieces"]))


def _lm_quant_build(p: LayerParts) -> lm_cache.QuantizedKVCache:
    m = p.meta
    new = lm_cache.QuantizedKVCache(group_size=m["group_size"], bits=m["bits"])
    if "pieces" in m:
        keys, values = _quant_pieces(p, "keys"), _quant_pieces(p, "values")
        new.state = (keys, values, m["offset"], m["group_size"], m["bits"])
    return new


def _vlm_quant_build(p: LayerParts) -> vlm_cache.QuantizedKVCache:
    m = p.meta
    new = vlm_cache.QuantizedKVCache(group_size=m["group_size"], bits=m["bits"])
    if "pieces" in m:
        new.state = (_quant_pieces(p, "keys"), _quant_pieces(p, "values"))
        new.meta_state = tuple(str(m[k]) for k in ("offset", "group_size", "bits"))
    return new


# --- ChannelQuantizedKVCache (4-bit: keys per channel) ---------------------------


def _channel_parts(c: Any) -> LayerParts:
    """The codes of its complete groups and the full-precision window it holds.

    Only groups below the current one are whole (a cut-back may have reopened
    one: its stale codes are dropped). The layout's tag and group size are
    what a restore needs to read the codes back the same way."""
    offset, held, g = int(c.offset), int(c.window_start[0]), int(c.group_size)
    meta = {"offset": offset, "window_start": held, "group_size": g, "bits": int(c.bits)}
    if c.window_keys is None:
        return LayerParts("mlxserve.ChannelQuantizedKVCache", meta)
    arrays: dict[str, mx.array | None] = {
        "window_keys": c.window_keys[:, :, : offset - held] if offset > held else None,
        "window_values": c.window_values[:, :, : offset - held] if offset > held else None,
    }
    sealed = offset // g * g
    per_word = 32 // int(c.bits)
    for i, per in enumerate((per_word, g, g)):
        arrays[f"keys.{i}"] = c.keys[i][..., : sealed // per] if sealed else None
        arrays[f"values.{i}"] = c.values[i][:, :, :sealed] if sealed else None
    meta["window_heads"] = int(c.window_keys.shape[1])
    meta["key_dim"], meta["value_dim"] = int(c.window_keys.shape[3]), int(c.window_values.shape[3])
    return LayerParts("mlxserve.ChannelQuantizedKVCache", meta, arrays)


def _channel_build(p: LayerParts) -> Any:
    from mlxserve.models.channel_cache import ChannelQuantizedKVCache

    m = p.meta
    new = ChannelQuantizedKVCache(group_size=m["group_size"], bits=m["bits"])
    new.lengths, new.window_start = [m["offset"]], [m["window_start"]]
    if "window_heads" not in m:
        return new
    new.restore(p.arrays, m["window_heads"], (m["key_dim"], m["value_dim"]))
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


def _rotating_parts(tag: str, c: Any, offset: int, idx: int) -> LayerParts:
    meta = {"keep": int(c.keep), "max_size": int(c.max_size), "offset": offset, "idx": idx}
    rows = 0 if c.keys is None else _rotating_rows(c.keys, offset, idx)
    return _kv_parts(tag, c.keys, c.values, rows, meta)


def _lm_rotating_parts(c: lm_cache.RotatingKVCache) -> LayerParts:
    if c.keys is None:
        return _rotating_parts("mlx_lm.RotatingKVCache", c, int(c.offset), 0)
    _, _, offset, _, _, idx = c.state
    return _rotating_parts("mlx_lm.RotatingKVCache", c, int(offset), int(idx))


def _lm_rotating_build(p: LayerParts) -> lm_cache.RotatingKVCache:
    m = p.meta
    new = lm_cache.RotatingKVCache(max_size=m["max_size"], keep=m["keep"])
    pair = _kv_pair(p)
    if pair is not None:
        new.state = (*pair, m["offset"], m["keep"], m["max_size"], m["idx"])
    return new


def _vlm_rotating_parts(c: vlm_cache.RotatingKVCache) -> LayerParts:
    # meta_state carries keep, max_size, offset and the write index.
    _, _, offset, idx = (int(v) for v in c.meta_state)
    return _rotating_parts("mlx_vlm.RotatingKVCache", c, offset, idx)


def _vlm_rotating_build(p: LayerParts) -> vlm_cache.RotatingKVCache:
    m = p.meta
    new = vlm_cache.RotatingKVCache(max_size=m["max_size"], keep=m["keep"])
    pair = _kv_pair(p)
    if pair is not None:
        new.state = pair
        new.meta_state = tuple(str(m[k]) for k in ("keep", "max_size", "offset", "idx"))
    return new


# --- ArraysCache (recurrent / conv state) ----------------------------------------


def _arrays_parts(tag: str, c: Any) -> LayerParts:
    if getattr(c, "is_speculating", False):
        raise UnsupportedCacheError(c, "cannot snapshot during a speculative block")
    arrays: dict[str, mx.array | None] = {f"cache.{i}": a for i, a in enumerate(c.cache)}
    arrays["left_padding"] = c.left_padding
    arrays["lengths"] = c.lengths
    return LayerParts(tag, {"size": len(c.cache)}, arrays)


def _arrays_list(p: LayerParts) -> list[Any]:
    return [p.arrays[f"cache.{i}"] for i in range(p.meta["size"])]


def _lm_arrays_build(p: LayerParts) -> lm_cache.ArraysCache:
    new = lm_cache.ArraysCache(p.meta["size"])
    new.state = (_arrays_list(p), p.arrays["left_padding"], p.arrays["lengths"])
    return new


def _vlm_arrays_build(p: LayerParts) -> vlm_cache.ArraysCache:
    new = vlm_cache.ArraysCache(p.meta["size"])
    new.state = _arrays_list(p)
    new.left_padding = p.arrays["left_padding"]
    new.lengths = p.arrays["lengths"]
    return new


# --- PoolingCache (mlx-vlm DeepSeek-V4 compressed KV) ----------------------------

_POOLING_FIELDS = ("buf_kv", "buf_gate", "pooled")
_CARRY_FIELDS = ("carry_kv", "carry_gate")


def _pooling_parts(c: Any, tag: str = "mlx_vlm.PoolingCache") -> LayerParts:
    if c.is_speculating:
        raise UnsupportedCacheError(c, "cannot snapshot during a speculative block")
    # The remainder buffers are written in place one row at a time up to
    # `ratio` rows, so they keep their full (small) size.
    arrays = {name: getattr(c, name) for name in _POOLING_FIELDS}
    return LayerParts(tag, {"ratio": int(c.ratio), "remainder": int(c.remainder)}, arrays)


def _pooling_build(p: LayerParts, new: Any = None) -> Any:
    new = vlm_cache.PoolingCache(p.meta["ratio"]) if new is None else new
    for name in _POOLING_FIELDS:
        setattr(new, name, p.arrays[name])
    new.remainder = p.meta["remainder"]
    return new


def _carrying_parts(c: Any) -> LayerParts:
    parts = _pooling_parts(c, "mlxserve.CarryingPoolingCache")
    parts.arrays.update({name: getattr(c, name) for name in _CARRY_FIELDS})
    return parts


def _carrying_build(p: LayerParts) -> Any:
    from mlxserve.models.deepseek_v4.overlap import CarryingPoolingCache

    new = _pooling_build(p, CarryingPoolingCache(p.meta["ratio"]))
    for name in _CARRY_FIELDS:
        setattr(new, name, p.arrays[name])
    return new


def _pooling_offset(c: Any) -> int | None:
    # Tokens seen: each pooled row stands for `ratio` tokens, plus the open group.
    return int(c.offset) * int(c.ratio) + int(c.remainder)


# --- DeepSeek-V4.1 LayerCache ------------------------------------------------------

_LAYER_FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")


def _v41_parts(c: lm_v41.LayerCache) -> LayerParts:
    meta = {"window_size": int(c.window_size), "offset": int(c.offset)}
    arrays = {name: getattr(c, name) for name in _LAYER_FIELDS}
    return LayerParts("mlx_lm.deepseek_v41.LayerCache", meta, arrays)


def _v41_build(p: LayerParts) -> lm_v41.LayerCache:
    # LayerCache has a state getter but no setter; its fields are public.
    new = lm_v41.LayerCache(p.meta["window_size"])
    new.offset = p.meta["offset"]
    for name in _LAYER_FIELDS:
        setattr(new, name, p.arrays[name])
    return new


# --- CacheList (recursive) ---------------------------------------------------------


def _cache_list_kind(cls: type, tag: str) -> Kind:
    def parts(c: Any) -> LayerParts:
        return LayerParts(tag, children=[layer_parts(sub) for sub in c.caches])

    def build(p: LayerParts) -> Any:
        return cls(*(build_layer(child) for child in p.children))

    def offset(c: Any) -> int | None:
        for sub in c.caches:
            off = kind_of(sub).offset(sub)
            if off is not None:
                return off
        return None

    def trimmable(c: Any) -> bool:
        return len(c.caches) > 0 and all(kind_of(sub).trimmable(sub) for sub in c.caches)

    return Kind(tag, parts, build, offset, trimmable)


def _channel_kind() -> type:
    from mlxserve.models.channel_cache import ChannelQuantizedKVCache

    return ChannelQuantizedKVCache


@functools.cache
def _registry() -> dict[type, Kind]:
    from mlxserve.models.deepseek_v4.overlap import CarryingPoolingCache

    def kv(tag: str, parts: Any, build: Any, trimmable: Callable[[Any], bool]) -> Kind:
        return Kind(tag, parts, build, _attr_offset, trimmable)

    def arrays_cache(tag: str, build: Any) -> Kind:
        parts = functools.partial(_arrays_parts, tag)
        return Kind(tag, parts, build, _no_offset, _never)

    return {
        lm_cache.KVCache: kv("mlx_lm.KVCache", _lm_kv_parts, _lm_kv_build, _always),
        vlm_cache.KVCache: kv("mlx_vlm.KVCache", _vlm_kv_parts, _vlm_kv_build, _always),
        lm_cache.QuantizedKVCache: kv(
            "mlx_lm.QuantizedKVCache",
            functools.partial(_quant_parts, "mlx_lm.QuantizedKVCache"),
            _lm_quant_build,
            _always,
        ),
        vlm_cache.QuantizedKVCache: kv(
            "mlx_vlm.QuantizedKVCache",
            functools.partial(_quant_parts, "mlx_vlm.QuantizedKVCache"),
            _vlm_quant_build,
            _always,
        ),
        # Cut back exactly to a group boundary (or within its window, `trim`): a
        # prefix-cache entry is trimmed back to a multiple of its group size.
        _channel_kind(): Kind(
            "mlxserve.ChannelQuantizedKVCache",
            _channel_parts,
            _channel_build,
            _attr_offset,
            _always,
            lambda c: int(c.group_size),
        ),
        # mlx-lm calls a rotating cache trimmable until it first fills; we never
        # do, so a window cache never gets a `prompt + output` entry.
        lm_cache.RotatingKVCache: kv(
            "mlx_lm.RotatingKVCache", _lm_rotating_parts, _lm_rotating_build, _never
        ),
        vlm_cache.RotatingKVCache: kv(
            "mlx_vlm.RotatingKVCache", _vlm_rotating_parts, _vlm_rotating_build, _never
        ),
        lm_cache.ArraysCache: arrays_cache("mlx_lm.ArraysCache", _lm_arrays_build),
        vlm_cache.ArraysCache: arrays_cache("mlx_vlm.ArraysCache", _vlm_arrays_build),
        vlm_cache.PoolingCache: Kind(
            "mlx_vlm.PoolingCache",
            _pooling_parts,
            _pooling_build,
            _pooling_offset,
            _never,
        ),
        CarryingPoolingCache: Kind(
            "mlxserve.CarryingPoolingCache",
            _carrying_parts,
            _carrying_build,
            _pooling_offset,
            _never,
        ),
        lm_v41.LayerCache: Kind(
            "mlx_lm.deepseek_v41.LayerCache",
            _v41_parts,
            _v41_build,
            _attr_offset,
            _never,
        ),
        lm_cache.CacheList: _cache_list_kind(lm_cache.CacheList, "mlx_lm.CacheList"),
        vlm_cache.CacheList: _cache_list_kind(vlm_cache.CacheList, "mlx_vlm.CacheList"),
    }


@functools.cache
def _by_tag() -> dict[str, Kind]:
    return {kind.tag: kind for kind in _registry().values()}


_TRIMMABLE_TAGS = frozenset(
    {
        "mlx_lm.KVCache",
        "mlx_vlm.KVCache",
        "mlx_lm.QuantizedKVCache",
        "mlx_vlm.QuantizedKVCache",
        "mlxserve.ChannelQuantizedKVCache",
    }
)


def layout_trimmable(layout: list[dict[str, Any]]) -> bool:
    """`is_trimmable` for a stored layout (`codec.py`): plain or quantized KV only."""

    def trimmable(node: dict[str, Any]) -> bool:
        children = node.get("children") or []
        if children:
            return all(trimmable(child) for child in children)
        return node.get("tag") in _TRIMMABLE_TAGS

    return bool(layout) and all(trimmable(node) for node in layout)


def layout_trim_step(layout: list[dict[str, Any]]) -> int:
    """`snapshot.trim_step` for a stored layout: the group size of keys quantized per
    channel (trimmed back only to its multiples), else 1."""
    steps = [1]
    pending = list(layout)
    while pending:
        node = pending.pop()
        pending.extend(node.get("children") or [])
        if node.get("tag") == "mlxserve.ChannelQuantizedKVCache":
            steps.append(int((node.get("meta") or {}).get("group_size", 1)))
    return max(steps)


def kind_of(cache: Any) -> Kind:
    """How to handle `cache`'s class; raises UnsupportedCacheError for any other."""
    kind = _registry().get(type(cache))
    if kind is None:
        raise UnsupportedCacheError(cache)
    return kind


def layer_parts(cache: Any) -> LayerParts:
    """One layer's cache as parts (its arrays sliced lazily to what it holds)."""
    return kind_of(cache).parts(cache)


def build_layer(parts: LayerParts) -> Any:
    """A new cache object of the class `parts.tag` names, holding `parts`' arrays.

    Raises ValueError for a tag no supported class has (a file from elsewhere).
    """
    kind = _by_tag().get(parts.tag)
    if kind is None:
        raise ValueError(f"unknown cache class tag {parts.tag!r}")
    return kind.build(parts)
