"""A per-layer cache list as a JSON layout plus named host buffers, and back.

Used by the disk tier on the engine's owner thread only: `encode` takes a
snapshot apart (`layers.py`) into a layout (each layer's class tag, integer
settings and which tensor holds each field) and evaluated, C-contiguous arrays
whose bytes a writer thread can read through `memoryview` without calling
MLX. `Restore` turns bytes read from disk back into arrays a slice of bytes at
a time (so a long entry comes back across several steps) and then builds the
cache objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxserve.cache.disk_file import Tensor
from mlxserve.cache.layers import LayerParts, build_layer, layer_parts

__all__ = ["EncodedCache", "Restore", "cache_layout", "encode"]

_DTYPES: dict[Any, str] = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}


@dataclass(frozen=True)
class EncodedCache:
    layout: list[dict[str, Any]]
    tensors: list[Tensor]  # memoryviews over `arrays`
    arrays: list[mx.array]  # the owner thread keeps them until the write is done


def _layout(parts: LayerParts, path: str, out: list[tuple[str, mx.array]]) -> dict[str, Any]:
    fields: dict[str, str | None] = {}
    for field, array in parts.arrays.items():
        if array is None:
            fields[field] = None
        else:
            name = f"{path}.{field}"
            out.append((name, array))
            fields[field] = name
    children = [_layout(child, f"{path}.{i}", out) for i, child in enumerate(parts.children)]
    return {"tag": parts.tag, "meta": dict(parts.meta), "arrays": fields, "children": children}


def cache_layout(caches: Sequence[Any]) -> list[dict[str, Any]]:
    """Each layer's class tag and settings (for a model's signature: its fresh caches)."""
    out: list[tuple[str, mx.array]] = []
    return [_layout(layer_parts(c), str(i), out) for i, c in enumerate(caches)]


def encode(caches: Sequence[Any]) -> EncodedCache:
    """Take a snapshot apart for writing. Evaluates what it must (normally nothing:
    a stored snapshot is already a real copy) and makes every array contiguous."""
    named: list[tuple[str, mx.array]] = []
    layout = [_layout(layer_parts(c), str(i), named) for i, c in enumerate(caches)]
    arrays = [a for _, a in named]
    mx.eval(arrays)
    tensors: list[Tensor] = []
    kept: list[mx.array] = []
    for name, array in named:
        view = _host_view(array)
        if not view.c_contiguous:
            view.release()
            array = mx.contiguous(array)
            mx.eval(array)
            view = _host_view(array)
        dtype = _DTYPES.get(array.dtype)
        if dtype is None:
            raise ValueError(f"cannot store a {array.dtype} array")
        tensors.append(Tensor(name, dtype, tuple(array.shape), view))
        kept.append(array)
    return EncodedCache(layout, tensors, kept)


def _host_view(array: mx.array) -> memoryview:
    """The evaluated array's own buffer (MLX arrays export the buffer protocol)."""
    return memoryview(array)  # type: ignore[arg-type]


def _parts(node: Any, arrays: Mapping[str, mx.array]) -> LayerParts:
    if not isinstance(node, dict) or not isinstance(node.get("tag"), str):
        raise ValueError("malformed cache layout")
    meta = node.get("meta", {})
    if not all(isinstance(k, str) and type(v) is int for k, v in meta.items()):
        raise ValueError("malformed cache layout settings")
    fields = {
        field: None if name is None else arrays[name]
        for field, name in node.get("arrays", {}).items()
    }
    children = [_parts(child, arrays) for child in node.get("children", [])]
    return LayerParts(node["tag"], dict(meta), fields, children)


class Restore:
    """Bytes read from disk back into cache objects, a slice of bytes per `advance`.

    Owner thread only (it creates MLX arrays). Raises ValueError when the
    stored layout or tensors do not make a cache (the entry is then a miss).
    """

    def __init__(self, layout: list[dict[str, Any]], tensors: Mapping[str, Tensor]) -> None:
        self.layout = layout
        self._pending = list(tensors.items())
        self._arrays: dict[str, mx.array] = {}
        self.nbytes = sum(len(t.data) for t in tensors.values())

    @property
    def done(self) -> bool:
        return not self._pending

    def advance(self, max_bytes: int) -> bool:
        """Turn stored tensors into arrays until about `max_bytes` were copied; True when done.

        At least one tensor is copied per call, so a restore always progresses.
        """
        copied = 0
        batch: list[mx.array] = []
        while self._pending and (not batch or copied < max_bytes):
            name, stored = self._pending.pop(0)
            array = _to_array(stored)
            self._arrays[name] = array
            batch.append(array)
            copied += len(stored.data)
        mx.eval(batch)
        return self.done

    def caches(self) -> list[Any]:
        """The restored cache objects (after `advance` returned True)."""
        if self._pending:
            raise RuntimeError("the restore has not finished")
        try:
            return [build_layer(_parts(node, self._arrays)) for node in self.layout]
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"stored cache does not fit its layout: {e}") from e


def _to_array(stored: Tensor) -> mx.array:
    dtype = _BY_NAME.get(stored.dtype)
    if dtype is None:
        raise ValueError(f"unknown stored dtype {stored.dtype!r}")
    count = int(np.prod(stored.shape, dtype=np.int64))
    if count * dtype.size != len(stored.data):
        raise ValueError("stored tensor size does not match its shape")
    raw = mx.array(np.frombuffer(stored.data, dtype=np.uint8))
    return raw.view(dtype).reshape(stored.shape)
