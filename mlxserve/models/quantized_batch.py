"""A left-padded batch of quantized KV caches, which mlx-lm 0.32.2 does not have.

mlx-lm has `QuantizedKVCache` (one sequence) and `BatchKVCache` (left-padded
rows, full precision), but no batched quantized form, so requests with
quantized caches could not decode together. `BatchQuantizedKVCache` is
`BatchKVCache` with each of keys and values held as mlx's affine-quantized
triple (packed codes, scales, biases), written in place in blocks of 256
positions. It has `bits` and `group_size`, so mlx-lm's attention
(`models.base.scaled_dot_product_attention`) takes its quantized path:
`mx.quantized_matmul` reads the codes, and no full-precision copy of the
keys and values is ever made.

Rows merge from, and extract back to, mlx-lm's own `QuantizedKVCache`, so a
request's cache, its prefix-cache snapshots and the disk tier keep using the
one-sequence class. Padding positions hold zero codes, scales and biases and
are masked out, as `BatchKVCache` masks its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

# Packed codes, scales, biases: what `mx.quantize` returns and `mx.quantized_matmul` takes.
Quantized = tuple[mx.array, mx.array, mx.array]


def _empty_triple(shape: tuple[int, ...], dim: int, dtype: mx.Dtype, bits: int, group: int) -> Any:
    per_word = 32 // bits
    return (
        mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
        mx.zeros((*shape, dim // group), dtype=dtype),
        mx.zeros((*shape, dim // group), dtype=dtype),
    )


def _rows(triple: Quantized, stop: int, start: int = 0) -> Quantized:
    a, b, c = (x[..., start:stop, :] for x in triple)
    return a, b, c


def _no_rows(like: Quantized, batch: int) -> Quantized:
    """`batch` rows of no positions, shaped and typed like `like`."""
    a, b, c = (mx.zeros((batch, x.shape[1], 0, x.shape[3]), x.dtype) for x in like)
    return a, b, c


def _stacked(first: Quantized, second: Quantized) -> Quantized:
    a, b, c = (mx.concatenate([x, y]) for x, y in zip(first, second, strict=True))
    return a, b, c


def _pad(triple: Quantized, left: int, right: int) -> Quantized:
    if left == 0 and right == 0:
        return triple
    widths = [(0, 0), (0, 0), (left, right), (0, 0)]
    a, b, c = (mx.pad(x, widths) for x in triple)
    return a, b, c


class _MaskedWidth:
    """The key width the last `make_mask` of a batch's layers covered, and the write
    position it was made at; the layers of one batch share one (`share_mask`)."""

    def __init__(self) -> None:
        self.idx = -1
        self.width = 0


def share_mask(layers: Sequence[Any]) -> None:
    """Let these layers (one model's batch) use the mask any of them makes.

    The model makes its mask from one layer (mlx-lm: the first); every layer
    updated from that position then hands attention its whole buffer, the
    unwritten rows masked out, instead of a slice: `mx.quantized_matmul` copies
    a sliced (strided) operand whole, which would copy the cache every step."""
    shared = _MaskedWidth()
    for layer in layers:
        if isinstance(layer, BatchQuantizedKVCache):
            layer.masked = shared


class BatchQuantizedKVCache:
    """Left-padded rows of quantized keys and values (see the module docstring).

    `offset` (per row) and `left_padding` are arrays, `_idx` the shared write
    position, as in mlx-lm's `BatchKVCache`.
    """

    step = 256

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 8) -> None:
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-pad for pad in left_padding])
        self._idx = 0
        self.group_size = group_size
        self.bits = bits
        self.masked = _MaskedWidth()

    # -- the forward's interface ------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        batch, heads, count, key_dim = keys.shape
        prev = self._idx
        if self.keys is None or self.values is None or prev + count > self.keys[0].shape[2]:
            steps = (self.step + count - 1) // self.step * self.step
            shape = (batch, heads, steps)
            fresh_k = _empty_triple(shape, key_dim, keys.dtype, self.bits, self.group_size)
            fresh_v = _empty_triple(
                shape, values.shape[3], values.dtype, self.bits, self.group_size
            )
            if self.keys is None or self.values is None:
                self.keys, self.values = fresh_k, fresh_v
            else:
                if prev % self.step != 0:
                    self.keys, self.values = _rows(self.keys, prev), _rows(self.values, prev)
                self.keys = self._joined(self.keys, fresh_k)
                self.values = self._joined(self.values, fresh_v)
        self.offset = self.offset + count
        self._idx += count
        new_k = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_v = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            # In place: the buffer is this cache's own (a shared one is copied by MLX first).
            self.keys[i][..., prev : self._idx, :] = new_k[i]
            self.values[i][..., prev : self._idx, :] = new_v[i]
        masked = self.masked
        if masked.idx == prev and masked.width == self.keys[0].shape[2]:
            return self.keys, self.values  # the rows past _idx are masked out
        return self.keys_and_values()

    def _width_after(self, count: int) -> int:
        """The buffer's rows once `count` more positions are written (see update_and_fetch)."""
        grown = (self.step + count - 1) // self.step * self.step
        if self.keys is None:
            return grown
        rows = int(self.keys[0].shape[2])
        if self._idx + count <= rows:
            return rows
        return (self._idx if self._idx % self.step else rows) + grown

    @staticmethod
    def _joined(old: Quantized, new: Quantized) -> Quantized:
        a, b, c = (mx.concatenate([x, y], axis=2) for x, y in zip(old, new, strict=True))
        return a, b, c

    def keys_and_values(self) -> tuple[Quantized, Quantized]:
        if self.keys is None or self.values is None:
            raise ValueError("the cache is empty")
        return _rows(self.keys, self._idx), _rows(self.values, self._idx)

    def make_mask(
        self,
        N: int,  # noqa: N803 (mlx-lm's name)
        return_array: bool = False,
        window_size: int | None = None,
        **_: Any,
    ) -> mx.array:
        """The causal, left-padding mask over the whole buffer the update will leave
        (rows not yet written are later than every query, so masked too)."""
        width = self._width_after(N)
        self.masked.idx, self.masked.width = self._idx, width
        keys = mx.arange(width)[None]
        queries = mx.arange(self._idx, self._idx + N)[:, None]
        mask = queries >= keys
        if window_size is not None:
            mask = mask & (queries < keys + window_size)
        return mask & (mx.expand_dims(self.left_padding, (1, 2, 3)) <= keys)

    # -- batch bookkeeping --------------------------------------------------------
    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only these rows (in this order), dropping padding every row now has."""
        rows = mx.array(list(batch_indices))
        if self.keys is not None and self.values is not None:
            a, b, c = (x[rows] for x in self.keys)
            d, e, f = (x[rows] for x in self.values)
            self.keys, self.values = (a, b, c), (d, e, f)
        self.offset = self.offset[rows]
        self.left_padding = self.left_padding[rows]
        shared = int(self.left_padding.min().item())  # type: ignore[arg-type]
        if shared > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _rows(self.keys, self.keys[0].shape[2], shared)
                self.values = _rows(self.values, self.values[0].shape[2], shared)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append `other`'s rows, right-aligning both at the longer write position."""
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError("cannot batch caches quantized differently")
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other
        (k1, v1, pad1), (k2, v2, pad2) = (_aligned(c, like, idx, size) for c in (self, other))
        self.keys = _stacked(k1, k2)
        self.values = _stacked(v1, v2)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([pad1, pad2])
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as mlx-lm's one-sequence cache (its own contiguous arrays)."""
        if self.keys is None or self.values is None:
            return QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        padding = int(self.left_padding[idx].item())  # type: ignore[arg-type]
        cache: Any = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        cache.keys = tuple(
            mx.contiguous(x[idx : idx + 1, :, padding : self._idx]) for x in self.keys
        )
        cache.values = tuple(
            mx.contiguous(x[idx : idx + 1, :, padding : self._idx]) for x in self.values
        )
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        """One-sequence quantized caches as a left-padded batch (all quantized alike)."""
        settings = {(c.group_size, c.bits) for c in caches}
        if len(settings) != 1:
            raise ValueError("cannot batch caches quantized differently")
        group_size, bits = settings.pop()
        lengths = [int(c.offset) for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, group_size=group_size, bits=bits)
        full = [c for c in caches if c.keys is not None and c.offset > 0]
        if longest == 0 or not full:
            return batch
        keys = [
            mx.zeros((len(caches), *x.shape[1:2], longest, x.shape[3]), x.dtype)
            for x in full[0].keys
        ]
        values = [
            mx.zeros((len(caches), *x.shape[1:2], longest, x.shape[3]), x.dtype)
            for x in full[0].values
        ]
        for row, (pad, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None or c.offset == 0:
                continue
            for i in range(3):
                keys[i][row : row + 1, :, pad:] = c.keys[i][..., : c.offset, :]
                values[i][row : row + 1, :, pad:] = c.values[i][..., : c.offset, :]
        batch.keys = (keys[0], keys[1], keys[2])
        batch.values = (values[0], values[1], values[2])
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    # -- what the rest of mlx-lm's cache interface asks -----------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


def _aligned(
    cache: BatchQuantizedKVCache, like: BatchQuantizedKVCache, idx: int, size: int
) -> tuple[Quantized, Quantized, mx.array]:
    """`cache`'s keys, values and left padding, right-aligned at `idx`, `size` rows long
    (`like`: a cache holding something, for the shapes of one that holds nothing)."""
    keys, values = cache.keys, cache.values
    if keys is None or values is None:
        rows = int(cache.offset.shape[0])
        assert like.keys is not None and like.values is not None
        keys, values = _no_rows(like.keys, rows), _no_rows(like.values, rows)
    left = idx - cache._idx
    right = size - keys[0].shape[2] - left
    if right < 0:
        keys, values = _rows(keys, right), _rows(values, right)
        right = 0
    return _pad(keys, left, right), _pad(values, left, right), cache.left_padding + left
