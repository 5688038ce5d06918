"""DeepSeek-V4 overlap compression that carries the previous window across calls.

mlx-vlm 0.7.10's ratio-4 compressor pools each window of 4 tokens together
with the first half of the window before it, but only for windows inside one
call: the first window of every call (each prefill chunk, every window that a
decode step completes, the remainder after a prefix-cache hit) sees zeros
instead. A prompt fed whole and the same prompt fed in chunks then produce
different logits, so chunked prefill and prefix-cache reuse would change the
output. DeepSeek's reference keeps the previous window in the compressor
state; this module does the same with our own small classes:

- `CarryingPoolingCache`: mlx-vlm's `PoolingCache` plus the last complete
  window (raw kv and gate), part of its `state`, so snapshots keep it.
- `CarryingCompressor`: wraps a model's `Compressor` module (its weights, norm
  and rope are reused) and pools with the carried window in front. Over a
  decode batch (`batch.BatchCarryingPoolingCache`) each row keeps its
  own carry, updated only when that row completes a window.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import CacheList, PoolingCache


class CarryingPoolingCache(PoolingCache):
    def __init__(self, ratio: int) -> None:
        super().__init__(ratio)
        self.carry_kv: mx.array | None = None
        self.carry_gate: mx.array | None = None

    @property
    def state(self) -> tuple[Any, ...]:
        return (*super().state, self.carry_kv, self.carry_gate)

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        *base, carry_kv, carry_gate = value
        PoolingCache.state.fset(self, tuple(base))  # type: ignore[attr-defined]
        self.carry_kv, self.carry_gate = carry_kv, carry_gate

    @property
    def nbytes(self) -> int:
        arrays = (*super().state, self.carry_kv, self.carry_gate)
        return sum(a.nbytes for a in arrays if a is not None)


def overlap_pool(kv: mx.array, gate: mx.array, ape: mx.array) -> mx.array:
    """Pool windows (B, N, R, 2D) -> (B, N, D); window i also sees window i-1's first half.

    Window 0 sees no predecessor (zeros with -inf gate), as at a sequence start.
    """
    batch, _, ratio, width = kv.shape
    half = width // 2
    gate = gate + ape.astype(gate.dtype)
    kv_a, kv_b = mx.split(kv, 2, axis=-1)
    gate_a, gate_b = mx.split(gate, 2, axis=-1)
    kv_a = mx.concatenate([mx.zeros((batch, 1, ratio, half), kv.dtype), kv_a[:, :-1]], axis=1)
    gate_a = mx.concatenate(
        [mx.full((batch, 1, ratio, half), -mx.inf, dtype=gate.dtype), gate_a[:, :-1]], axis=1
    )
    merged_kv = mx.concatenate([kv_a, kv_b], axis=2)
    weights = mx.softmax(mx.concatenate([gate_a, gate_b], axis=2), axis=-2, precise=True)
    return (merged_kv * weights.astype(merged_kv.dtype)).sum(axis=-2)


class CarryingCompressor(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, pool_cache: Any, offset: Any) -> mx.array:
        if hasattr(pool_cache, "set_carry"):  # batch.BatchCarryingPoolingCache
            return self._call_batch(x, pool_cache, offset)
        if not isinstance(pool_cache, CarryingPoolingCache):
            return self.inner(x, pool_cache, offset)
        ready = self._ready_windows(x, pool_cache, offset)
        if ready is None:
            return pool_cache.update_and_fetch(self._empty(x))
        windows_kv, windows_gate, pool_base = ready
        carry_kv, carry_gate = pool_cache.carry_kv, pool_cache.carry_gate
        carried = carry_kv is not None and carry_gate is not None
        if carry_kv is not None and carry_gate is not None:
            windows_kv = mx.concatenate([carry_kv[:, None], windows_kv], axis=1)
            windows_gate = mx.concatenate([carry_gate[:, None], windows_gate], axis=1)
        pooled = overlap_pool(windows_kv, windows_gate, self.inner.ape)
        if carried:
            pooled = pooled[:, 1:]
        # Real copies: the pooling buffer is written again by the next call.
        pool_cache.carry_kv = mx.contiguous(windows_kv[:, -1]) + 0
        pool_cache.carry_gate = mx.contiguous(windows_gate[:, -1]) + 0
        return pool_cache.update_and_fetch(self._place(pooled, pool_base))

    def _call_batch(self, x: mx.array, pool_cache: Any, offset: Any) -> mx.array:
        """Rows of a batch complete windows at different steps; each keeps its own carry."""
        ready = self._ready_windows(x, pool_cache, offset)
        if ready is None:
            return pool_cache.update_and_fetch(self._empty(x))
        windows_kv, windows_gate, pool_base = ready
        carry_kv, carry_gate = pool_cache.carry_for(windows_kv, windows_gate)
        # Column 0 is each row's carried window; row i's real windows are 1..n_i
        # (rows that completed fewer windows are zero-padded after theirs).
        windows_kv = mx.concatenate([carry_kv[:, None], windows_kv], axis=1)
        windows_gate = mx.concatenate([carry_gate[:, None], windows_gate], axis=1)
        if pool_cache.is_speculating:  # a verify forward: its kept windows pick the carry
            pool_cache.record_windows(windows_kv, windows_gate)
        pooled = overlap_pool(windows_kv, windows_gate, self.inner.ape)[:, 1:]
        before = pool_cache.pool_lengths()
        fetched = pool_cache.update_and_fetch(self._place(pooled, pool_base))
        completed = [n - b for n, b in zip(pool_cache.pool_lengths(), before, strict=True)]
        # A row's new carry is its last completed window (column 0, the old carry, if none).
        rows = mx.arange(len(completed))
        last = mx.array(completed, dtype=mx.int32)
        pool_cache.set_carry(windows_kv[rows, last], windows_gate[rows, last], completed)
        return fetched

    def _ready_windows(
        self, x: mx.array, pool_cache: Any, offset: Any
    ) -> tuple[mx.array, mx.array, Any] | None:
        """The windows this call completes, as (B, N, R, 2D) kv and gate, and their base."""
        inner = self.inner
        ready_kv, ready_gate, pool_base = pool_cache.accumulate_windows(
            inner.wkv(x), inner.wgate(x), offset
        )
        if ready_kv.size == 0:
            return None
        ratio = inner.compress_ratio
        windows_kv = mx.unflatten(ready_kv, 1, (-1, ratio))
        windows_gate = mx.unflatten(ready_gate, 1, (-1, ratio))
        return windows_kv, windows_gate, pool_base

    def _empty(self, x: mx.array) -> mx.array:
        return mx.zeros((x.shape[0], 0, self.inner.head_dim), dtype=x.dtype)

    def _place(self, pooled: mx.array, pool_base: Any) -> mx.array:
        """Normalise pooled entries and rotate them to their positions."""
        pooled = self.inner.norm(pooled)
        return self.inner.rope(pooled[:, None], offset=pool_base).squeeze(1)


def install(language_model: Any) -> int:
    """Wrap every overlapping compressor of an mlx-vlm DeepSeek-V4 language model."""
    wrapped = 0
    for layer in language_model.layers:
        attention = layer.attn
        owners = [attention, getattr(attention, "indexer", None)]
        for owner in (o for o in owners if o is not None):
            compressor = getattr(owner, "compressor", None)
            if compressor is not None and getattr(compressor, "overlap", False):
                owner.compressor = CarryingCompressor(compressor)
                wrapped += 1
    return wrapped


def make_cache(language_model: Any) -> list[Any]:
    """The model's own cache layout, with ratio-4 pooling caches that carry a window."""
    return [_convert(cache) for cache in language_model.make_cache()]


def _convert(cache: Any) -> Any:
    if isinstance(cache, CacheList):
        return CacheList(*(_convert(child) for child in cache.caches))
    if type(cache) is PoolingCache and cache.ratio == 4:
        return CarryingPoolingCache(cache.ratio)
    return cache
