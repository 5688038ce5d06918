"""DeepSeek-V4.1 attention math, restated from mlx-lm 0.32.2's `deepseek_v41` module.

These are that module's private helpers (fake fp8/fp4 rounding, sparse
attention over gathered rows) and its RoPE helper with a vector of per-row
offsets. The batched decode (`models/deepseek_v4/v41_batch.py`) runs them so a batch
row computes what a single run does; we keep our own copy rather than import
private names. `tests/test_dsv41_batch.py` checks each is bit-equal to
mlx-lm's on random inputs, so a version bump that changes the math fails there.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def rotate(
    x: mx.array,
    rope: Any,
    *,
    rope_dim: int,
    offset: mx.array,
    scale: float = 1.0,
    inverse: bool = False,
) -> mx.array:
    """Interleaved RoPE on the trailing `rope_dim` features, one offset per batch row.

    mlx-lm's `_apply_rope` takes one int offset; `mx.fast.rope` takes a (B,)
    vector, one position per batch row.
    """
    if rope_dim == 0:
        return x
    head = x[..., :-rope_dim]
    tail = x[..., -rope_dim:].astype(mx.float32)
    if x.ndim == 4:  # (B, L, H, D): rope wants positions on the second-to-last axis
        tail = rope(tail.transpose(0, 2, 1, 3), offset=offset, scale=scale, inverse=inverse)
        tail = tail.transpose(0, 2, 1, 3)
    else:
        tail = rope(tail, offset=offset, scale=scale, inverse=inverse)
    return mx.concatenate([head, tail.astype(x.dtype)], axis=-1)


def fake_quant_fp8(x: mx.array, block_size: int = 32) -> mx.array:
    """Round-trip FP8 e4m3 with power-of-two block scales."""
    if x.shape[-1] % block_size:
        return x
    dtype, shape = x.dtype, x.shape
    blocks = x.astype(mx.float32).reshape(*shape[:-1], -1, block_size)
    amax = mx.maximum(mx.max(mx.abs(blocks), axis=-1, keepdims=True), 1e-4)
    scale = mx.power(2.0, mx.ceil(mx.log2(amax / 448.0)))
    quantized = mx.clip(blocks / scale, -448.0, 448.0)
    return (mx.from_fp8(mx.to_fp8(quantized), mx.float32) * scale).reshape(shape).astype(dtype)


_FP4_LUT = mx.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=mx.float32)


def _round_fp4(x: mx.array) -> mx.array:
    mag = mx.abs(x)
    idx = mx.zeros(mag.shape, dtype=mx.int32)
    for threshold in (0.25, 1.25, 2.5, 5.0):
        idx = idx + (mag > threshold).astype(mx.int32)
    for threshold in (0.75, 1.75, 3.5):
        idx = idx + (mag >= threshold).astype(mx.int32)
    return mx.sign(x) * _FP4_LUT[idx]


def fake_quant_fp4(x: mx.array, *, block_size: int, e4m3_scale: bool = False) -> mx.array:
    """Round to FP4 (e2m1) with per-block scales (e4m3 or power-of-two)."""
    if x.shape[-1] % block_size:
        return x
    dtype, shape = x.dtype, x.shape
    blocks = x.astype(mx.float32).reshape(*shape[:-1], -1, block_size)
    floor = 6.0 * 2.0**-9 if e4m3_scale else 6.0 * 2.0**-126
    amax = mx.maximum(mx.max(mx.abs(blocks), axis=-1, keepdims=True), floor)
    if e4m3_scale:
        scale = mx.from_fp8(mx.to_fp8(amax / 6.0), mx.float32)
    else:
        scale = mx.power(2.0, mx.ceil(mx.log2(amax / 6.0)))
    q = _round_fp4(mx.clip(blocks / scale, -6.0, 6.0)) * scale
    return q.reshape(shape).astype(dtype)


def _gather_rows(values: mx.array, indices: mx.array) -> mx.array:
    batch, length, dim = values.shape
    safe = mx.maximum(indices, 0)
    base = (mx.arange(batch, dtype=mx.int32) * length).reshape(batch, 1, 1)
    flat = values.reshape(batch * length, dim)
    return flat[(safe + base).reshape(-1)].reshape(*indices.shape, dim)


def sparse_attention(
    q: mx.array,
    kvs: list[mx.array],
    indices: list[mx.array],
    *,
    sinks: mx.array,
    scale: float,
) -> mx.array:
    """Attend each query (q: B, S, H, D) to the rows its indices (B, S, k) pick; -1 picks none."""
    batch, length, heads, dim = q.shape
    rows = [_gather_rows(kv, idx) for kv, idx in zip(kvs, indices, strict=True)]
    # Each query has its own keys, so each query is one batch entry.
    keys = mx.concatenate(rows, axis=2).reshape(batch * length, 1, -1, dim)
    keys = keys.astype(mx.float32)
    mask = mx.concatenate(indices, axis=-1) >= 0
    # SDPA rounds the scores to the input dtype at this head size, so use fp32.
    out = mx.fast.scaled_dot_product_attention(
        q.reshape(batch * length, heads, 1, dim).astype(mx.float32),
        keys,
        keys,
        scale=scale,
        mask=mask.reshape(batch * length, 1, 1, -1),
        sinks=sinks.astype(mx.float32),
    )
    return out.reshape(batch, length, heads, dim).astype(q.dtype)
