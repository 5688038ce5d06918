"""Attention over a cache whose keys are quantized per channel (`channel_cache.py`).

mlx-lm's models call `models.base.scaled_dot_product_attention` with what the
cache's `update_and_fetch` returned; for a cache with `bits` it calls
`quantized_scaled_dot_product_attention` from that module's globals (mlx-lm
0.32.2, pinned). `install_attention` wraps that one function: what our cache
returns (`Fetched`) goes to `channel_attention`, anything else to mlx-lm's
own, unchanged. No model code is touched, and mlx-lm's own quantized caches
keep their path.

Per query at position p, in one softmax:
- positions of earlier groups (below p's group's start), from the quantized
  buffers: keys stored transposed, so `mx.quantized_matmul(q, keys,
  transpose=False)` gives the scores with the groups along the positions;
  values rotated (`rotate`), their weighted sum rotated back;
- positions of p's own group up to p, from the full-precision window.
The masks follow each row's own positions, so the model's mask (built for
left-padded rows) is not used; the cache's `make_mask` returns None.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx_lm.models.base as lm_base


def rotate(x: mx.array, group: int) -> mx.array:
    """`x` times the orthonormal Hadamard matrix of each group of `group` channels
    (its own inverse: `rotate(rotate(x, g), g) == x` up to rounding)."""
    dim = x.shape[-1]
    if dim == group:
        return mx.hadamard_transform(x)
    grouped = x.reshape(*x.shape[:-1], dim // group, group)
    return mx.hadamard_transform(grouped).reshape(x.shape)


class Fetched(tuple[mx.array, mx.array]):
    """What the cache hands the attention: the full-precision window arrays, with the
    cache, each row's position of the first query and of the window's first column.

    A tuple, so the model passes it on as keys and as values without looking in."""

    cache: Any
    first: mx.array
    fp_start: mx.array

    def __new__(
        cls, cache: Any, keys: mx.array, values: mx.array, first: mx.array, fp_start: mx.array
    ) -> Fetched:
        fetched = super().__new__(cls, (keys, values))
        fetched.cache, fetched.first, fetched.fp_start = cache, first, fp_start
        return fetched


def channel_attention(queries: mx.array, fetched: Fetched, scale: float) -> mx.array:
    cache = fetched.cache
    fp_keys, fp_values = fetched
    batch, query_heads, count, dim = queries.shape
    kv_heads = fp_keys.shape[1]
    group = cache.group_size
    q = (queries * scale).reshape(batch, kv_heads, query_heads // kv_heads, count, dim)
    position = (fetched.first[:, None] + mx.arange(count)[None]).reshape(batch, 1, 1, count, 1)
    group_start = position // group * group
    low = mx.array(mx.finfo(q.dtype).min, q.dtype)
    columns = fetched.fp_start.reshape(batch, 1, 1, 1, 1) + mx.arange(fp_keys.shape[2])
    own_group = (columns <= position) & (columns >= group_start)
    scores = [mx.where(own_group, q @ mx.expand_dims(fp_keys, 2).swapaxes(-1, -2), low)]
    quantized = cache.keys is not None and cache.capacity() > 0
    if quantized:
        codes, scales, biases = (mx.expand_dims(x, 2) for x in cache.keys)
        earlier = mx.quantized_matmul(
            q, codes, scales, biases, transpose=False, group_size=group, bits=cache.bits
        )
        before = mx.arange(earlier.shape[-1]) < group_start
        scores.insert(0, mx.where(before, earlier, low))
    weights = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
    window = fp_keys.shape[2]
    out = weights[..., -window:] @ mx.expand_dims(fp_values, 2)
    if quantized:
        codes, scales, biases = (mx.expand_dims(x, 2) for x in cache.values)
        summed = mx.quantized_matmul(
            weights[..., :-window],
            codes,
            scales,
            biases,
            transpose=False,
            group_size=group,
            bits=cache.bits,
        )
        out = out + rotate(summed, group)
    return out.reshape(batch, query_heads, count, fp_values.shape[3])


def install_attention() -> None:
    """Route `Fetched` keys to `channel_attention` (idempotent; see the module docstring)."""
    original = lm_base.quantized_scaled_dot_product_attention
    if getattr(original, "routes_channel_caches", False):
        return

    def quantized_attention(
        queries: mx.array,
        q_keys: Any,
        q_values: Any,
        scale: float,
        mask: Any,
        group_size: int = 64,
        bits: int = 8,
    ) -> mx.array:
        if isinstance(q_keys, Fetched):
            return channel_attention(queries, q_keys, scale)
        return original(queries, q_keys, q_values, scale, mask, group_size, bits)

    quantized_attention.routes_channel_caches = True  # type: ignore[attr-defined]
    lm_base.quantized_scaled_dot_product_attention = quantized_attention
