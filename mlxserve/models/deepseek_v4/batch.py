"""Batched DeepSeek-V4 caches: merge per-request caches so requests decode as one batch.

mlx-vlm 0.7.10 has batched forms of the V4 caches (`BatchRotatingKVCache`,
`BatchPoolingCache`, with per-row lengths; rows complete their pooling windows
at different steps). Our ratio-4 `CarryingPoolingCache` also carries the last
complete window; `BatchCarryingPoolingCache` keeps one carried window per row:

- `carry_kv` / `carry_gate`: (B, R, 2D). A row with no complete window yet
  holds zeros with a `-inf` gate, which pools exactly as "no predecessor".
- `has_carry`: per-row flag, so `extract` gives back a cache equal to the
  single-request one (carry `None` where the row had none).

`merge_layer` turns one request's layer cache into a batch of one; `mergeable`
says whether a layer cache can be merged at all (checked on an empty probe).
DeepSeek-V4.1's `LayerCache` (mlx-lm) merges into `v41_cache.BatchLayerCache`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.deepseek_v41 import LayerCache
from mlx_vlm.models.cache import (
    BatchPoolingCache,
    BatchRotatingKVCache,
    CacheList,
    PoolingCache,
    RotatingKVCache,
)

from mlxserve.models.deepseek_v4.overlap import CarryingPoolingCache
from mlxserve.models.deepseek_v4.v41_cache import BatchLayerCache


class BatchCarryingPoolingCache(BatchPoolingCache):
    """`BatchPoolingCache` plus each row's previous complete window (see module doc)."""

    def __init__(self, ratio: int, left_padding: list[int]) -> None:
        super().__init__(ratio, left_padding)
        self.carry_kv: mx.array | None = None
        self.carry_gate: mx.array | None = None
        self.has_carry: list[bool] = [False] * len(left_padding)
        # While a verify forward runs: the carry before it, the pool lengths before
        # it, and the windows it pooled (column 0: the carry it started from).
        self._carry_before: tuple[Any, Any, list[bool]] | None = None
        self._pools_before: list[int] = []
        self._spec_windows: tuple[mx.array, mx.array] | None = None

    # -- carry bookkeeping ----------------------------------------------------
    def carry_for(self, windows_kv: mx.array, windows_gate: mx.array) -> tuple[mx.array, mx.array]:
        """Per-row carried window (B, R, 2D); rows without one get the empty sentinel."""
        if self.carry_kv is not None and self.carry_gate is not None:
            return self.carry_kv, self.carry_gate
        batch, _, ratio, _ = windows_kv.shape
        return _sentinel(batch, ratio, windows_kv, windows_gate)

    def set_carry(self, carry_kv: mx.array, carry_gate: mx.array, completed: list[int]) -> None:
        """Store the new carry; `completed[i]` = windows row i completed in this call."""
        # Real copies: the arrays they come from are written again by later calls.
        self.carry_kv = mx.contiguous(carry_kv) + 0
        self.carry_gate = mx.contiguous(carry_gate) + 0
        self.has_carry = [had or n > 0 for had, n in zip(self.has_carry, completed, strict=True)]

    def pool_lengths(self) -> list[int]:
        return [int(n) for n in self.offset.tolist()]

    # -- speculation: a verify forward, then the kept positions ---------------
    # mlx-vlm's transaction (`start_speculative_cache`) keeps the pools of the kept
    # positions; the carry must then be the last window those positions completed.
    def start_speculation(self, length: int) -> int:
        generation = int(super().start_speculation(length))
        self._carry_before = (self.carry_kv, self.carry_gate, list(self.has_carry))
        self._pools_before = self.pool_lengths()
        self._spec_windows = None
        return generation

    def record_windows(self, windows_kv: mx.array, windows_gate: mx.array) -> None:
        """The windows a speculative call pooled, carry first (see `CarryingCompressor`)."""
        self._spec_windows = (windows_kv, windows_gate)

    def commit_speculation(self, lengths: Any, generation: int | None = None) -> None:
        super().commit_speculation(lengths, generation)
        windows, self._spec_windows = self._spec_windows, None
        assert self._carry_before is not None
        carry_kv, carry_gate, had = self._carry_before
        self._carry_before = None
        if windows is None:  # the forward completed no window: the carry stands
            self.carry_kv, self.carry_gate, self.has_carry = carry_kv, carry_gate, had
            return
        after = self.pool_lengths()
        kept = [n - before for n, before in zip(after, self._pools_before, strict=True)]
        rows, last = mx.arange(len(kept)), mx.array(kept, dtype=mx.int32)
        self.carry_kv = mx.contiguous(windows[0][rows, last]) + 0
        self.carry_gate = mx.contiguous(windows[1][rows, last]) + 0
        self.has_carry = [carried or n > 0 for carried, n in zip(had, kept, strict=True)]

    def abort_speculation(self, generation: int | None = None) -> None:
        super().abort_speculation(generation)
        if self._carry_before is not None:
            self.carry_kv, self.carry_gate, self.has_carry = self._carry_before
        self._carry_before, self._spec_windows = None, None

    # -- state ----------------------------------------------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        return (*super().state, self.carry_kv, self.carry_gate)

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        *base, carry_kv, carry_gate = value
        BatchPoolingCache.state.fset(self, tuple(base))  # type: ignore[attr-defined]
        self.carry_kv, self.carry_gate = carry_kv, carry_gate

    @property
    def nbytes(self) -> int:
        carry = sum(a.nbytes for a in (self.carry_kv, self.carry_gate) if a is not None)
        return int(super().nbytes) + carry

    # -- batch operations -----------------------------------------------------
    def filter(self, batch_indices: Any) -> None:
        source: Any = batch_indices
        if isinstance(source, mx.array):
            source = source.tolist()
        rows = [int(i) for i in source]
        super().filter(rows)
        self.has_carry = [self.has_carry[i] for i in rows]
        if self.carry_kv is not None and self.carry_gate is not None:
            index = mx.array(rows, dtype=mx.int32)
            self.carry_kv = self.carry_kv[index]
            self.carry_gate = self.carry_gate[index]

    def extend(self, other: Any) -> None:
        mine, theirs = len(self.remainder), len(other.remainder)
        other_kv = getattr(other, "carry_kv", None)
        other_gate = getattr(other, "carry_gate", None)
        if self.carry_kv is not None or other_kv is not None:
            like_kv = self.carry_kv if self.carry_kv is not None else other_kv
            like_gate = self.carry_gate if self.carry_gate is not None else other_gate
            assert like_kv is not None and like_gate is not None
            ratio = like_kv.shape[1]
            if self.carry_kv is None or self.carry_gate is None:
                self.carry_kv, self.carry_gate = _sentinel(mine, ratio, like_kv, like_gate)
            if other_kv is None or other_gate is None:
                other_kv, other_gate = _sentinel(theirs, ratio, like_kv, like_gate)
            self.carry_kv = mx.concatenate([self.carry_kv, other_kv], axis=0)
            self.carry_gate = mx.concatenate([self.carry_gate, other_gate], axis=0)
        super().extend(other)
        self.has_carry = self.has_carry + list(getattr(other, "has_carry", [False] * theirs))

    def extract(self, idx: int) -> CarryingPoolingCache:
        base = super().extract(idx)
        cache = CarryingPoolingCache(self.ratio)
        cache.pooled, cache.remainder = base.pooled, base.remainder
        cache.buf_kv, cache.buf_gate = base.buf_kv, base.buf_gate
        if self.has_carry[idx] and self.carry_kv is not None and self.carry_gate is not None:
            cache.carry_kv = mx.contiguous(self.carry_kv[idx : idx + 1])
            cache.carry_gate = mx.contiguous(self.carry_gate[idx : idx + 1])
        return cache

    @classmethod
    def merge(cls, caches: list[Any], prefix_lens: Any = None) -> BatchCarryingPoolingCache:
        """Merge per-request `CarryingPoolingCache`s (batch 1 each) into one batch."""
        merged = super().merge(caches, prefix_lens)
        assert isinstance(merged, BatchCarryingPoolingCache)
        carries: list[tuple[mx.array, mx.array] | None] = []
        for cache in caches:
            kv, gate = getattr(cache, "carry_kv", None), getattr(cache, "carry_gate", None)
            carries.append((kv, gate) if kv is not None and gate is not None else None)
        merged.has_carry = [pair is not None for pair in carries]
        like = next((pair for pair in carries if pair is not None), None)
        if like is not None:
            empty = _sentinel(1, like[0].shape[1], *like)
            rows = [empty if pair is None else pair for pair in carries]
            merged.carry_kv = mx.concatenate([kv for kv, _ in rows], axis=0)
            merged.carry_gate = mx.concatenate([gate for _, gate in rows], axis=0)
        return merged


def _sentinel(
    batch: int, ratio: int, like_kv: mx.array, like_gate: mx.array
) -> tuple[mx.array, mx.array]:
    """`batch` empty carried windows: zeros with a -inf gate (no predecessor)."""
    kv = mx.zeros((batch, ratio, like_kv.shape[-1]), dtype=like_kv.dtype)
    gate = mx.full((batch, ratio, like_gate.shape[-1]), -mx.inf, dtype=like_gate.dtype)
    return kv, gate


# -- merging one request's layer caches ----------------------------------------


def mergeable(layer: Any) -> bool:
    """Whether `merge_layer` can turn this (mlx-vlm, or V4.1) layer cache into a batch."""
    if type(layer) is CacheList:
        return all(mergeable(child) for child in layer.caches)
    return type(layer) in (RotatingKVCache, CarryingPoolingCache, PoolingCache, LayerCache)


def merge_layer(layer: Any) -> Any:
    """One request's layer cache as a batch of one, ready to `extend`/`filter`."""
    kind = type(layer)
    if kind is CacheList:
        return CacheList(*(merge_layer(child) for child in layer.caches))
    if kind is RotatingKVCache:
        return BatchRotatingKVCache.merge([layer])
    if kind is CarryingPoolingCache:
        return BatchCarryingPoolingCache.merge([layer])
    if kind is PoolingCache:
        return BatchPoolingCache.merge([layer])
    if kind is LayerCache:  # DeepSeek-V4.1 (its model wrapped by dsv41_batch.install)
        return BatchLayerCache.merge([layer])
    raise TypeError(f"{kind.__name__} cannot be merged into a decode batch")
