"""The 4-bit KV cache (`--kv-cache-bits 4`): keys quantized per channel.

mlx-lm's `QuantizedKVCache` quantizes each position's key on its own, in groups
of channels. Keys have outlier channels (a few channels much larger than the
rest, nearly constant along the sequence), so at 4 bits each group's scale
follows the outliers and the other channels round to a few levels: on
SmolLM2-135M only 78% of teacher-forced positions kept their greedy token
(`mlxserve bench kv-quant`). Here, as in KIVI (Liu et al., 2024), each key
channel is quantized along the sequence instead: `group_size` consecutive
positions of one channel share a scale and a bias, which follow that
channel's own range. Values are quantized per position as before, after a
Hadamard rotation of each group of channels (stored `V·H`, attention output
rotated back by `H`, which is its own inverse), which spreads a group's
outliers over its channels (QuaRot, Ashkboos et al., 2024).

A group of positions is quantized once all of it is written. Until then its
keys and values stay in full precision in a small window, and attention
reads a query's own group from there: every query sees positions of earlier
groups quantized and positions of its own group in full precision, whatever
the chunking, so a cold run, a batch, a prefix-cache hit and a disk restore
compute the same thing. The window also keeps the last complete group, so
that a cache can be cut back (speculative decoding's rejected drafts) into
it exactly; it holds at most `2 * group_size - 1` positions a row.

Attention (`channel_attention.py`) reads the codes with `mx.quantized_matmul`
(keys stored transposed, so their groups run along the positions, which that
kernel takes with `transpose=False`); no full-precision copy of the cache is
made. Rows of a batch are aligned at position 0 (not left-padded as mlx-lm's
batches are), so the groups of every row start at the same columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx

from mlxserve.models.channel_attention import Fetched, install_attention, rotate

install_attention()

# Packed codes, scales, biases: what `mx.quantize` returns and `mx.quantized_matmul` takes.
Quantized = tuple[mx.array, mx.array, mx.array]


def _grown(
    triple: Quantized, axes: tuple[int, int, int], widths: tuple[int, int, int]
) -> Quantized:
    """`triple` with each array padded with zeros along its position axis to `widths`."""
    out = []
    for x, axis, width in zip(triple, axes, widths, strict=True):
        extra = width - x.shape[axis]
        if extra > 0:
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, extra)
            x = mx.pad(x, pad)
        out.append(x)
    return out[0], out[1], out[2]


class _ChannelRows:
    """Rows of one layer's cache (see the module docstring).

    `lengths[i]`: positions row i holds; `window_start[i]`: the first position
    its window holds in full precision (a multiple of `group_size`, at most the
    start of its current group); `pads[i]`: left padding of the next forward's
    inputs (a grouped prefill's), dropped as they arrive. Host-side lists: the
    bookkeeping never waits for the device.
    """

    step = 256  # positions the quantized buffers grow by (a multiple of every group size)

    def __init__(self, rows: int, group_size: int, bits: int) -> None:
        self.group_size = group_size
        self.bits = bits
        self.lengths = [0] * rows
        self.window_start = [0] * rows
        self.pads = [0] * rows
        # (B, H, D, capacity // per word), scales and biases (B, H, D, capacity // group).
        self.keys: Quantized | None = None
        # (B, H, capacity, D // per word), scales and biases (B, H, capacity, D // group).
        self.values: Quantized | None = None
        # (B, H, 2 * group, D): row i's positions window_start[i]... from column 0.
        self.window_keys: mx.array | None = None
        self.window_values: mx.array | None = None

    # -- the forward's interface ------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Fetched, Fetched]:
        if self.window_keys is None or self.window_values is None:
            width = 2 * self.group_size
            self.window_keys = mx.zeros((*keys.shape[:2], width, keys.shape[3]), keys.dtype)
            self.window_values = mx.zeros((*values.shape[:2], width, values.shape[3]), values.dtype)
        first = mx.array([n - p for n, p in zip(self.lengths, self.pads, strict=True)])
        fp_start = mx.array(self.window_start)
        if keys.shape[2] == 1 and not any(self.pads):
            fp_keys, fp_values = self._write_one(keys, values)
        else:
            fp_keys, fp_values = self._write_many(keys, values)
        self.pads = [0] * len(self.lengths)
        fetched = Fetched(self, fp_keys, fp_values, first, fp_start)
        return fetched, fetched

    def _write_one(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """A decode step: one position a row, written into each row's window."""
        assert self.window_keys is not None and self.window_values is not None
        slots = mx.array([n - w for n, w in zip(self.lengths, self.window_start, strict=True)])
        hit = (
            mx.arange(self.window_keys.shape[2])[None, None, :, None] == slots[:, None, None, None]
        )
        # New arrays, not writes in place: the attention reads these as they are now,
        # while a row that completes its group below shifts its window.
        self.window_keys = mx.where(hit, keys, self.window_keys)
        self.window_values = mx.where(hit, values, self.window_values)
        fetched = self.window_keys, self.window_values
        self.lengths = [n + 1 for n in self.lengths]
        for row, n in enumerate(self.lengths):
            if n % self.group_size == 0:
                self._seal_last(row)
        return fetched

    def _seal_last(self, row: int) -> None:
        """Row `row` just completed a group: quantize it, keep it as the window's older group."""
        assert self.window_keys is not None and self.window_values is not None
        g = self.group_size
        start, held = self.lengths[row] - g, self.window_start[row]
        keys = self.window_keys[row : row + 1, :, start - held : start - held + g]
        values = self.window_values[row : row + 1, :, start - held : start - held + g]
        self._store(row, start, keys, values)
        if start > held:
            self.window_keys = _shifted_row(self.window_keys, row, start - held)
            self.window_values = _shifted_row(self.window_values, row, start - held)
            self.window_start[row] = start

    def _write_many(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """A prefill: each row's new positions (past its padding), complete groups quantized."""
        assert self.window_keys is not None and self.window_values is not None
        g = self.group_size
        fp_keys, fp_values, windows_k, windows_v = [], [], [], []
        for row, (n, held, pad) in enumerate(
            zip(self.lengths, self.window_start, self.pads, strict=True)
        ):
            k = mx.concatenate(
                [self.window_keys[row : row + 1, :, : n - held], keys[row : row + 1, :, pad:]], 2
            )
            v = mx.concatenate(
                [self.window_values[row : row + 1, :, : n - held], values[row : row + 1, :, pad:]],
                2,
            )
            end = n + keys.shape[2] - pad
            done = end // g * g
            if done > n // g * g:
                a, b = n // g * g - held, done - held
                self._store(row, n // g * g, k[:, :, a:b], v[:, :, a:b])
            kept = max(held, done - g)
            fp_keys.append(k)
            fp_values.append(v)
            windows_k.append(k[:, :, kept - held :])
            windows_v.append(v[:, :, kept - held :])
            self.lengths[row], self.window_start[row] = end, kept
        self.window_keys = _stacked(windows_k, 2 * g)
        self.window_values = _stacked(windows_v, 2 * g)
        width = max(x.shape[2] for x in fp_keys)
        return _stacked(fp_keys, width), _stacked(fp_values, width)

    def _store(self, row: int, start: int, keys: mx.array, values: mx.array) -> None:
        """Quantize whole groups of row `row` (positions `start`...) into the buffers."""
        count = keys.shape[2]
        self._reserve(keys, values, start + count)
        assert self.keys is not None and self.values is not None
        g, per_word = self.group_size, 32 // self.bits
        codes = mx.quantize(keys.swapaxes(-1, -2), group_size=g, bits=self.bits)
        for mine, new, per in zip(self.keys, codes, (per_word, g, g), strict=True):
            mine[row : row + 1, ..., start // per : (start + count) // per] = new
        codes = mx.quantize(rotate(values, g), group_size=g, bits=self.bits)
        for mine, new in zip(self.values, codes, strict=True):
            mine[row : row + 1, :, start : start + count, :] = new

    def _reserve(self, keys: mx.array, values: mx.array, positions: int) -> None:
        """Grow the quantized buffers (every row) to hold `positions`."""
        capacity = self.capacity()
        if positions <= capacity:
            return
        capacity = (positions + self.step - 1) // self.step * self.step
        if self.keys is None or self.values is None:
            dims = keys.shape[3], values.shape[3]
            rows, heads = len(self.lengths), keys.shape[1]
            self.keys, self.values = _empty(
                rows, heads, dims, keys.dtype, self.bits, self.group_size
            )
        self.keys, self.values = _with_capacity(
            self.keys, self.values, capacity, self.bits, self.group_size
        )

    def capacity(self) -> int:
        return 0 if self.values is None else int(self.values[0].shape[2])

    def make_mask(self, *_: Any, **__: Any) -> None:
        """No mask: the attention masks by the rows' own positions (`channel_attention`)."""
        return None

    # -- what the rest of mlx-lm's cache interface asks -----------------------------
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last `n` positions of every row (up to the shortest row's length).

        Exact where each row keeps its current group's positions in its window
        (a cut-back of fewer than `group_size` positions always does) or ends on a
        group boundary; raises ValueError otherwise: the cut group's keys would be
        needed in full precision, and only their codes are left."""
        n = min(n, *self.lengths) if self.lengths else 0
        kept = [length - n for length in self.lengths]
        g = self.group_size
        for length, held in zip(kept, self.window_start, strict=True):
            if length % g and length // g * g < held:
                raise ValueError(
                    f"cannot cut a cache quantized per channel back to {length} positions: "
                    f"only whole groups of {g} (or its last {2 * g - 1} positions) can be"
                )
        self.window_start = [
            min(held, length) for held, length in zip(self.window_start, kept, strict=True)
        ]
        self.lengths = kept
        return n

    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return self.window_keys is None

    @property
    def nbytes(self) -> int:
        held = [*(self.keys or ()), *(self.values or ())]
        held += [x for x in (self.window_keys, self.window_values) if x is not None]
        return sum(x.nbytes for x in held)


def _shifted_row(window: mx.array, row: int, by: int) -> mx.array:
    """`window` with row `row` moved `by` columns to the left (a new array)."""
    moved = mx.pad(window[row : row + 1, :, by:], [(0, 0), (0, 0), (0, by), (0, 0)])
    return mx.concatenate([window[:row], moved, window[row + 1 :]])


def _stacked(rows: list[mx.array], width: int) -> mx.array:
    """One-row arrays of up to `width` columns (axis 2), zero-padded on the right, stacked."""
    padded = [mx.pad(x, [(0, 0), (0, 0), (0, width - x.shape[2]), (0, 0)]) for x in rows]
    return mx.concatenate(padded) if len(padded) > 1 else padded[0]


def _empty(
    rows: int, heads: int, dims: tuple[int, int], dtype: mx.Dtype, bits: int, group: int
) -> tuple[Quantized, Quantized]:
    """Quantized buffers of no positions (`_with_capacity` widens them)."""
    key_dim, value_dim = dims
    keys = (
        mx.zeros((rows, heads, key_dim, 0), mx.uint32),
        mx.zeros((rows, heads, key_dim, 0), dtype),
        mx.zeros((rows, heads, key_dim, 0), dtype),
    )
    values = (
        mx.zeros((rows, heads, 0, value_dim * bits // 32), mx.uint32),
        mx.zeros((rows, heads, 0, value_dim // group), dtype),
        mx.zeros((rows, heads, 0, value_dim // group), dtype),
    )
    return keys, values


def _with_capacity(
    keys: Quantized, values: Quantized, capacity: int, bits: int, group: int
) -> tuple[Quantized, Quantized]:
    per_word = 32 // bits
    keys = _grown(keys, (3, 3, 3), (capacity // per_word, capacity // group, capacity // group))
    values = _grown(values, (2, 2, 2), (capacity,) * 3)
    return keys, values


class ChannelQuantizedKVCache(_ChannelRows):
    """One request's cache (mlx-lm's one-sequence interface: an integer `offset`)."""

    def __init__(self, group_size: int = 64, bits: int = 4) -> None:
        super().__init__(1, group_size, bits)

    @property
    def offset(self) -> int:
        return self.lengths[0]

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.window_keys, self.window_values

    @classmethod
    def from_full(
        cls,
        keys: mx.array | None,
        values: mx.array | None,
        offset: int,
        group_size: int,
        bits: int,
    ) -> ChannelQuantizedKVCache:
        """The cache a full-precision one holding `offset` positions becomes."""
        cache = cls(group_size, bits)
        if keys is not None and values is not None and offset > 0:
            cache.update_and_fetch(keys[..., :offset, :], values[..., :offset, :])
        return cache

    def restore(
        self, arrays: Mapping[str, mx.array | None], heads: int, dims: tuple[int, int]
    ) -> None:
        """Take the arrays of a snapshot (`cache/layers.py`): the window's held columns
        and the codes of the complete groups, widened back to buffers."""
        held_keys, held_values = arrays.get("window_keys"), arrays.get("window_values")
        keys = [arrays.get(f"keys.{i}") for i in range(3)]
        values = [arrays.get(f"values.{i}") for i in range(3)]
        like = held_keys if held_keys is not None else keys[1]
        if like is None:
            return  # nothing written yet: the first write makes the buffers
        width = 2 * self.group_size
        self.window_keys = _window(held_keys, (1, heads, width, dims[0]), like.dtype)
        self.window_values = _window(held_values, (1, heads, width, dims[1]), like.dtype)
        if keys[0] is None or values[0] is None:
            return
        capacity = -(-int(values[0].shape[2]) // self.step) * self.step
        self.keys, self.values = _with_capacity(
            (keys[0], keys[1], keys[2]),  # type: ignore[arg-type]
            (values[0], values[1], values[2]),  # type: ignore[arg-type]
            capacity,
            self.bits,
            self.group_size,
        )


def _window(held: mx.array | None, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A window buffer of `shape` holding `held`'s columns first (zeros without any)."""
    if held is None:
        return mx.zeros(shape, dtype)
    return mx.pad(held, [(0, 0), (0, 0), (0, shape[2] - held.shape[2]), (0, 0)])


class BatchChannelQuantizedKVCache(_ChannelRows):
    """Rows of several requests, merged from and extracted back to their own caches."""

    @property
    def offset(self) -> mx.array:
        """Each row's position of the next forward's first input (padding included)."""
        return mx.array([n - p for n, p in zip(self.lengths, self.pads, strict=True)])

    @classmethod
    def padded(
        cls, pads: Sequence[int], group_size: int, bits: int
    ) -> BatchChannelQuantizedKVCache:
        """Fresh rows for one left-padded forward of whole prompts (a grouped prefill)."""
        batch = cls(len(pads), group_size, bits)
        batch.pads = list(pads)
        return batch

    @classmethod
    def merge(cls, caches: Sequence[_ChannelRows]) -> BatchChannelQuantizedKVCache:
        settings = {(c.group_size, c.bits) for c in caches}
        if len(settings) != 1:
            raise ValueError("cannot batch caches quantized differently")
        group_size, bits = settings.pop()
        batch = cls(0, group_size, bits)
        for cache in caches:
            batch._append(cache)
        return batch

    def extend(self, other: _ChannelRows) -> None:
        if (other.group_size, other.bits) != (self.group_size, self.bits):
            raise ValueError("cannot batch caches quantized differently")
        self._append(other)

    def _append(self, other: _ChannelRows) -> None:
        """`other`'s rows after these (buffers widened to the larger capacity)."""
        rows, theirs = len(self.lengths), len(other.lengths)
        like = self if self.window_keys is not None else other
        if like.window_keys is not None and like.window_values is not None:
            mine_k = self.window_keys if self.window_keys is not None else None
            self.window_keys = _joined_windows(
                mine_k, other.window_keys, like.window_keys, rows, theirs
            )
            self.window_values = _joined_windows(
                self.window_values, other.window_values, like.window_values, rows, theirs
            )
        like_q = self if self.keys is not None else other
        if like_q.keys is not None and like_q.values is not None:
            capacity = max(self.capacity(), other.capacity())
            mine = _quantized_rows(self, like_q, rows, capacity)
            their = _quantized_rows(other, like_q, theirs, capacity)
            self.keys = _concat(mine[0], their[0])
            self.values = _concat(mine[1], their[1])
        self.lengths = self.lengths + other.lengths
        self.window_start = self.window_start + other.window_start
        self.pads = self.pads + other.pads

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only these rows, in this order."""
        rows = mx.array(list(batch_indices))
        if self.keys is not None and self.values is not None:
            self.keys = _taken(self.keys, rows)
            self.values = _taken(self.values, rows)
        if self.window_keys is not None and self.window_values is not None:
            self.window_keys, self.window_values = self.window_keys[rows], self.window_values[rows]
        for name in ("lengths", "window_start", "pads"):
            held = getattr(self, name)
            setattr(self, name, [held[i] for i in batch_indices])

    def extract(self, idx: int) -> ChannelQuantizedKVCache:
        """Row `idx` as a one-request cache (arrays of its own, sized to what it holds)."""
        cache = ChannelQuantizedKVCache(self.group_size, self.bits)
        cache.lengths, cache.window_start = [self.lengths[idx]], [self.window_start[idx]]
        if self.window_keys is not None and self.window_values is not None:
            cache.window_keys = mx.contiguous(self.window_keys[idx : idx + 1])
            cache.window_values = mx.contiguous(self.window_values[idx : idx + 1])
        sealed = self.lengths[idx] // self.group_size * self.group_size
        if self.keys is not None and self.values is not None and sealed:
            capacity = min(self.capacity(), -(-sealed // self.step) * self.step)
            per_word, g = 32 // self.bits, self.group_size
            a, b, c = (
                mx.contiguous(x[idx : idx + 1, ..., : capacity // per])
                for x, per in zip(self.keys, (per_word, g, g), strict=True)
            )
            d, e, f = (mx.contiguous(x[idx : idx + 1, :, :capacity]) for x in self.values)
            cache.keys, cache.values = (a, b, c), (d, e, f)
        return cache

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.window_keys, self.window_values


def _joined_windows(
    mine: mx.array | None, theirs: mx.array | None, like: mx.array, rows: int, their_rows: int
) -> mx.array:
    shape = like.shape[1:]
    a = mine if mine is not None else mx.zeros((rows, *shape), like.dtype)
    b = theirs if theirs is not None else mx.zeros((their_rows, *shape), like.dtype)
    return mx.concatenate([a, b])


def _quantized_rows(
    cache: _ChannelRows, like: _ChannelRows, rows: int, capacity: int
) -> tuple[Quantized, Quantized]:
    """`cache`'s quantized buffers at `capacity` (empty ones shaped like `like`'s)."""
    keys, values = cache.keys, cache.values
    if keys is None or values is None:
        assert like.keys is not None and like.values is not None
        heads, key_dim = like.keys[0].shape[1], like.keys[0].shape[2]
        dims = key_dim, like.values[1].shape[3] * like.group_size
        keys, values = _empty(rows, heads, dims, like.keys[1].dtype, like.bits, like.group_size)
    return _with_capacity(keys, values, capacity, cache.bits, cache.group_size)


def _concat(first: Quantized, second: Quantized) -> Quantized:
    a, b, c = (mx.concatenate([x, y]) for x, y in zip(first, second, strict=True))
    return a, b, c


def _taken(triple: Quantized, rows: mx.array) -> Quantized:
    a, b, c = (x[rows] for x in triple)
    return a, b, c
