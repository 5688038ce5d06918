"""A decode batch of DeepSeek-V4.1 layer caches (mlx-lm 0.32.2 `deepseek_v41.LayerCache`).

mlx-lm's `LayerCache` holds one sequence: the sliding window, the closed
compressed groups (`compress_kv`) and their index keys (`index_k`), and the
rows of the group still open (`pending_kv` / `pending_gate`). It has no
batched form. `BatchLayerCache` holds the same fields for many rows, each row
at its own position:

- `offsets`: tokens each row has seen (Python ints, so no step waits on the device).
- `window`: (B, W, D), right-aligned; row b's last `min(offsets[b], window_size)`
  columns are real, the columns in front of them zeros.
- `compress`, `index`, `pending_kv`, `pending_gate`: `RowBuffer`s, left-aligned
  (B, capacity, D) with a length per row; columns past a row's length hold
  finite filler that no query sees.

`merge` turns per-request caches into a batch, `extend` / `filter` add and
drop rows, `extract` gives one row back as a plain `LayerCache` that decodes
on exactly as that request would have. The batched forward that reads and
writes these fields is `models/deepseek_v4/v41_batch.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.deepseek_v41 import LayerCache


def _pad_columns(a: mx.array, width: int, *, left: bool) -> mx.array:
    """(B, n, D) -> (B, width, D) with zero columns in front (left) or after."""
    missing = width - a.shape[1]
    if missing <= 0:
        return a
    pad = mx.zeros((a.shape[0], missing, *a.shape[2:]), dtype=a.dtype)
    return mx.concatenate([pad, a] if left else [a, pad], axis=1)


class RowBuffer:
    """Per-row sequences of (D,) entries, left-aligned in one (B, capacity, D) array."""

    def __init__(self, data: mx.array | None, lengths: list[int]) -> None:
        self.data = data
        self.lengths = lengths

    @classmethod
    def merge(cls, rows: Sequence[mx.array | None]) -> RowBuffer:
        """One buffer from each row's (1, n, D) array (None: the row has none yet)."""
        lengths = [0 if a is None else int(a.shape[1]) for a in rows]
        like = next((a for a in rows if a is not None), None)
        if like is None:
            return cls(None, lengths)
        width = max(lengths)
        parts = [
            _pad_columns(a, width, left=False)
            if a is not None
            else mx.zeros((1, width, *like.shape[2:]), dtype=like.dtype)
            for a in rows
        ]
        return cls(mx.concatenate(parts, axis=0), lengths)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def view(self) -> mx.array | None:
        """The used columns (B, max length, D), or None when no row has an entry."""
        longest = max(self.lengths, default=0)
        if self.data is None or longest == 0:
            return None
        return self.data[:, :longest]

    def full(self) -> mx.array:
        """Every column (B, capacity, D); the caller knows which are real."""
        assert self.data is not None
        return self.data

    def put(self, values: mx.array, advance: Sequence[bool] | None = None) -> None:
        """Write values (B, 1, D) at each row's length; those rows in `advance` grow by one.

        A row that does not advance gets the entry written past its end, where
        nothing reads it and its next real entry overwrites it.
        """
        batch = values.shape[0]
        # Exactly as wide as the longest row: the memory probe measures a
        # single run's caches, which hold no slack either.
        needed = max(self.lengths, default=0) + 1
        if self.data is None:
            self.data = mx.zeros((batch, needed, *values.shape[2:]), dtype=values.dtype)
        elif self.data.shape[1] < needed:
            self.data = _pad_columns(self.data, needed, left=False)
        at = mx.array(self.lengths, dtype=mx.int32).reshape(batch, 1, 1)
        at = mx.broadcast_to(at, values.shape)
        self.data = mx.put_along_axis(self.data, at, values.astype(self.data.dtype), axis=1)
        grow = [True] * batch if advance is None else advance
        self.lengths = [n + int(g) for n, g in zip(self.lengths, grow, strict=True)]

    def reset(self, rows: Sequence[bool]) -> None:
        """Rows flagged True start over (their entries become filler)."""
        self.lengths = [0 if r else n for n, r in zip(self.lengths, rows, strict=True)]
        self.trim()

    def trim(self) -> None:
        """Drop the columns past the longest row."""
        longest = max(self.lengths, default=0)
        if self.data is not None and self.data.shape[1] > longest:
            self.data = self.data[:, :longest]

    def filter(self, keep: list[int]) -> None:
        self.lengths = [self.lengths[i] for i in keep]
        if self.data is not None:
            self.data = self.data[mx.array(keep, dtype=mx.int32)]
        self.trim()

    def extend(self, other: RowBuffer) -> None:
        if self.data is None and other.data is None:
            self.lengths = self.lengths + other.lengths
            return
        like = self.data if self.data is not None else other.data
        assert like is not None
        mine = self.data if self.data is not None else _zeros_like_rows(like, self.rows)
        theirs = other.data if other.data is not None else _zeros_like_rows(like, other.rows)
        width = max(mine.shape[1], theirs.shape[1])
        self.data = mx.concatenate(
            [_pad_columns(mine, width, left=False), _pad_columns(theirs, width, left=False)],
            axis=0,
        )
        self.lengths = self.lengths + other.lengths

    def extract(self, row: int, keep_empty: bool) -> mx.array | None:
        """Row `row` as (1, n, D); with no entries None, or (1, 0, D) if `keep_empty`."""
        n = self.lengths[row]
        if self.data is None or (n == 0 and not keep_empty):
            return None
        return mx.contiguous(self.data[row : row + 1, :n])


def _zeros_like_rows(like: mx.array, rows: int) -> mx.array:
    return mx.zeros((rows, like.shape[1], *like.shape[2:]), dtype=like.dtype)


class BatchLayerCache:
    """Many requests' `LayerCache`s for one layer, rows at different positions (module doc)."""

    def __init__(self, window_size: int, offsets: list[int]) -> None:
        self.window_size = window_size
        self.offsets = offsets
        self.window: mx.array | None = None
        self.compress = RowBuffer(None, [0] * len(offsets))
        self.index = RowBuffer(None, [0] * len(offsets))
        self.pending_kv = RowBuffer(None, [0] * len(offsets))
        self.pending_gate = RowBuffer(None, [0] * len(offsets))

    # -- what mlx-lm's TextModel reads ------------------------------------------
    @property
    def offset(self) -> mx.array:
        """Each row's position (B,); TextModel passes it to the layers as `start_pos`."""
        return mx.array(self.offsets, dtype=mx.int32)

    def window_rows(self, row: int) -> int:
        return min(self.offsets[row], self.window_size)

    # -- the batched forward's updates -------------------------------------------
    def update_window(self, kv: mx.array) -> tuple[mx.array, mx.array]:
        """Append one token per row (B, 1, D); return the window and each row's indices.

        The indices (B, 1, width) pick the rows a query attends to, in the order
        a single run has them (oldest first), then -1 for none.
        """
        window = kv if self.window is None else mx.concatenate([self.window, kv], axis=1)
        self.offsets = [n + kv.shape[1] for n in self.offsets]
        seen = [self.window_rows(b) for b in range(len(self.offsets))]
        width = max(seen)
        total = window.shape[1]
        count = mx.array(seen, dtype=mx.int32)[:, None]
        column = mx.arange(width, dtype=mx.int32)[None, :]
        indices = mx.where(column < count, total - count + column, -1)
        self.window = window[:, total - width :]
        return window, indices[:, None, :]

    # -- batch operations ----------------------------------------------------------
    @classmethod
    def merge(cls, caches: Sequence[LayerCache]) -> BatchLayerCache:
        if not caches:
            raise ValueError("nothing to merge")
        sizes = {c.window_size for c in caches}
        if len(sizes) != 1:
            raise ValueError(f"layer caches with different window sizes {sorted(sizes)}")
        merged = cls(sizes.pop(), [int(c.offset) for c in caches])
        windows = [c.window for c in caches]
        like = next((w for w in windows if w is not None), None)
        if like is not None:
            width = max(merged.window_rows(b) for b in range(len(caches)))
            merged.window = mx.concatenate(
                [
                    _pad_columns(w[:, w.shape[1] - merged.window_rows(b) :], width, left=True)
                    if w is not None
                    else mx.zeros((1, width, like.shape[-1]), dtype=like.dtype)
                    for b, w in enumerate(windows)
                ],
                axis=0,
            )
        merged.compress = RowBuffer.merge([c.compress_kv for c in caches])
        merged.index = RowBuffer.merge([c.index_k for c in caches])
        merged.pending_kv = RowBuffer.merge([c.pending_kv for c in caches])
        merged.pending_gate = RowBuffer.merge([c.pending_gate for c in caches])
        return merged

    def assign(self, caches: Sequence[LayerCache]) -> None:
        """Hold exactly these caches' rows, as `merge` would, in this same object (the
        decode batch keeps its layer objects)."""
        self.__dict__.update(BatchLayerCache.merge(caches).__dict__)

    def _buffers(self) -> tuple[RowBuffer, ...]:
        return (self.compress, self.index, self.pending_kv, self.pending_gate)

    def extend(self, other: BatchLayerCache) -> None:
        if other.window_size != self.window_size:
            raise ValueError("cannot extend a batch with a different window size")
        if self.window is None or other.window is None:
            like = self.window if self.window is not None else other.window
            if like is not None:
                if self.window is None:
                    self.window = mx.zeros((len(self.offsets), 0, like.shape[-1]), like.dtype)
                if other.window is None:
                    other.window = mx.zeros((len(other.offsets), 0, like.shape[-1]), like.dtype)
        if self.window is not None and other.window is not None:
            width = max(self.window.shape[1], other.window.shape[1])
            self.window = mx.concatenate(
                [
                    _pad_columns(self.window, width, left=True),
                    _pad_columns(other.window, width, left=True),
                ],
                axis=0,
            )
        for mine, theirs in zip(self._buffers(), other._buffers(), strict=True):
            mine.extend(theirs)
        self.offsets = self.offsets + other.offsets

    def filter(self, batch_indices: Any) -> None:
        """Keep these rows, in this order."""
        source: Any = batch_indices
        if isinstance(source, mx.array):
            source = source.tolist()
        keep = [int(i) for i in source]
        self.offsets = [self.offsets[i] for i in keep]
        if self.window is not None:
            width = max((self.window_rows(b) for b in range(len(keep))), default=0)
            rows = self.window[mx.array(keep, dtype=mx.int32)]
            self.window = rows[:, rows.shape[1] - width :]
        for buffer in self._buffers():
            buffer.filter(keep)

    def extract(self, idx: int) -> Any:
        """Row `idx` as the `LayerCache` a single run would hold now (copies)."""
        cache: Any = LayerCache(self.window_size)  # its fields are untyped (None)
        cache.offset = self.offsets[idx]
        rows = self.window_rows(idx)
        if self.window is not None and rows > 0:
            width = self.window.shape[1]
            cache.window = mx.contiguous(self.window[idx : idx + 1, width - rows :])
        cache.compress_kv = self.compress.extract(idx, keep_empty=False)
        cache.index_k = self.index.extract(idx, keep_empty=False)
        # A compressing layer keeps an (empty) open group once it has run.
        cache.pending_kv = self.pending_kv.extract(idx, keep_empty=True)
        cache.pending_gate = self.pending_gate.extract(idx, keep_empty=True)
        return cache

    # -- accounting --------------------------------------------------------------
    def _arrays(self) -> list[mx.array]:
        arrays = [self.window, *(b.data for b in self._buffers())]
        return [a for a in arrays if a is not None]

    @property
    def state(self) -> tuple[mx.array, ...]:
        return (*self._arrays(), self.offset)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._arrays())

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return all(n == 0 for n in self.offsets)

    @property
    def size(self) -> int:
        return len(self.offsets)
