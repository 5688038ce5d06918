"""DeepSeek-V4.1 attention over a decode batch whose rows sit at different positions.

mlx-lm 0.32.2's `deepseek_v41` runs a batch as one sequence position: the
layers get one `start_pos` (an int) and one set of sliding-window indices, the
compressor closes a group when the shared open-group length reaches the
ratio, and the indexer's visibility mask is per position, not per row. Rows
that joined at different prompt lengths are at different positions, and
nothing in that forward can be told so.

`BatchableAttention` wraps each layer's `Attention` module (its weights,
norms and rope are the model's own). With a plain `LayerCache` it calls the
wrapped module unchanged; with a `BatchLayerCache` (`models/deepseek_v4/v41_cache.py`)
it decodes one token per row, each at its own position:

- RoPE rotates each row by its own offset (`mx.fast.rope` takes a vector);
- each row attends to its own last `min(offset + 1, window)` window rows;
- each row's open group fills at its own pace; a row closes a group (and
  appends one compressed entry and index key) on the step its group fills;
- the indexer's visibility, top-k and candidate blocks are per row.

The rest of the forward (embedding, hyper-connections, MoE, head) runs as
mlx-lm's own code: it is position-independent. The attention math comes from
`models/deepseek_v4/v41_math.py` (mlx-lm's own helpers, restated, RoPE with per-row
offsets). `tests/test_dsv41_batch.py` holds greedy parity against single runs.

One case cannot match a single run: with a candidate source whose blocks
cover fewer entries than `index_topk`, the top-k picks among tied -inf
scores, in an order that depends on the row's width. The published config
(2048 blocks of 8 against a top-k of 512) never gets there.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve.models.deepseek_v4.v41_cache import BatchLayerCache
from mlxserve.models.deepseek_v4.v41_math import (
    fake_quant_fp4,
    fake_quant_fp8,
    rotate,
    sparse_attention,
)

Shared = dict[str, Any]


class BatchableAttention(nn.Module):
    """A V4.1 `Attention` that also decodes a `BatchLayerCache` (see module doc)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(
        self,
        x: mx.array,
        *,
        start_pos: Any,
        window_idx: mx.array,
        cache: Any,
        shared: Shared,
    ) -> mx.array:
        if isinstance(cache, BatchLayerCache):
            return batched_attention(self.inner, x, cache, shared)
        return self.inner(x, start_pos=start_pos, window_idx=window_idx, cache=cache, shared=shared)


def install(language_model: Any) -> int:
    """Wrap every attention module of an mlx-lm `deepseek_v41.Model`; returns how many."""
    wrapped = 0
    for layer in language_model.model.layers:
        if layer is None:
            continue  # another pipeline stage's layer (`models/shard.py`)
        if not isinstance(layer.self_attn, BatchableAttention):
            layer.self_attn = BatchableAttention(layer.self_attn)
            wrapped += 1
    return wrapped


def batched_attention(attn: Any, x: mx.array, cache: BatchLayerCache, shared: Shared) -> mx.array:
    """`Attention.__call__` for one decode token per row, each row at its own offset."""
    batch, length, _ = x.shape
    if length != 1:
        raise ValueError(f"a V4.1 decode batch takes one token per row, not {length}")
    positions = cache.offset  # (B,) tokens before this one, per row
    q_residual = attn.q_a_norm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_residual).reshape(batch, length, attn.num_heads, attn.head_dim)
    q = rotate(q, attn.rope, rope_dim=attn.rope_dim, offset=positions)

    kv = attn.kv_norm(attn.kv_proj(x))
    kv = rotate(kv, attn.rope, rope_dim=attn.rope_dim, offset=positions)
    kv = fake_quant_fp8(kv, 32)
    window, window_idx = cache.update_window(kv)
    kvs, indices = [window], [window_idx]
    if attn.ratio:
        if attn.is_kv_source:
            _compress(attn, x, positions, cache, shared)
        if attn.is_index_source:
            picks, candidates = _index(attn, x, q_residual, positions, shared)
            shared["topk_idx"] = picks
            if attn.indexer.is_candidate_source:
                shared["candidates"] = candidates
        compressed = shared.get("compress_kv")
        topk = shared.get("topk_idx")
        if compressed is not None and topk is not None and topk.shape[-1] > 0:
            kvs.append(compressed)
            indices.append(topk)

    output = sparse_attention(q, kvs, indices, sinks=attn.sinks, scale=attn.head_dim**-0.5)
    output = rotate(output, attn.rope, rope_dim=attn.rope_dim, offset=positions, inverse=True)
    output = output.reshape(batch * length, attn.o_groups, 1, -1)
    output = attn.o_a_proj(output, mx.arange(attn.o_groups)[None])
    return attn.o_b_proj(output.reshape(batch, length, -1))


def _pool(attn: Any, x: mx.array, cache: BatchLayerCache) -> tuple[mx.array | None, list[bool]]:
    """The compressor for one token per row: (latents (B, 1, D) or None, rows that closed one).

    Rows that did not close a group get a latent too (from their partial
    group); it is written past their last entry, where nothing reads it.
    """
    compressor = attn.compressor
    ratio = compressor.ratio
    batch = x.shape[0]
    if ratio == 1:
        return compressor.kv_norm(compressor.kv_proj(x)), [True] * batch
    h = x.astype(mx.float32)
    cache.pending_kv.put(compressor.kv_proj(h))
    cache.pending_gate.put(compressor.gate_proj(h))
    closed = [n == ratio for n in cache.pending_kv.lengths]
    if not any(closed):
        return None, closed
    kv = cache.pending_kv.full()[:, None, :ratio]
    gate = cache.pending_gate.full()[:, None, :ratio]
    cache.pending_kv.reset(closed)
    cache.pending_gate.reset(closed)
    latent = mx.sum(kv * mx.softmax(gate, axis=2), axis=2)
    return compressor.kv_norm(latent.astype(x.dtype)), closed


def _compress(
    attn: Any, x: mx.array, positions: mx.array, cache: BatchLayerCache, shared: Shared
) -> None:
    """`Attention._compress` per row: append the closed groups, share the entries so far."""
    latent, closed = _pool(attn, x, cache)
    if latent is not None:
        # A group takes the position of its first token: its index times the ratio.
        first = positions // attn.ratio
        kv = rotate(latent, attn.rope, rope_dim=attn.rope_dim, offset=first, scale=attn.ratio)
        kv = fake_quant_fp4(kv, block_size=16, e4m3_scale=True)
        cache.compress.put(kv, closed)
        if attn.is_index_source:
            indexer = attn.indexer
            k = indexer.k_norm(indexer.k_proj(latent))
            k = rotate(k, attn.rope, rope_dim=attn.rope_dim, offset=first, scale=attn.ratio)
            k = fake_quant_fp4(k, block_size=32)
            cache.index.put(k, closed)
    shared["compress_kv"] = cache.compress.view()
    if attn.is_index_source:
        shared["index_k"] = cache.index.view()


def _index(
    attn: Any, x: mx.array, q_residual: mx.array, positions: mx.array, shared: Shared
) -> tuple[mx.array, mx.array | None]:
    """`Indexer.__call__` with each row's own visible groups (B, 1, k), -1 for none."""
    indexer = attn.indexer
    index_k = shared.get("index_k")
    candidates = shared.get("candidates")
    batch, length, _ = x.shape
    if index_k is None or index_k.shape[1] == 0:
        return mx.zeros((batch, length, 0), dtype=mx.int32), candidates
    q = indexer.q_b_proj(q_residual).reshape(batch, length, indexer.num_heads, indexer.head_dim)
    q = rotate(q, attn.rope, rope_dim=indexer.rope_dim, offset=positions)
    q = fake_quant_fp4(q, block_size=32)
    keys = index_k.astype(mx.float32)
    weights = indexer.weights_proj(x).astype(mx.float32) * (indexer.num_heads**-0.5)
    scores = mx.matmul(q.astype(mx.float32), keys[:, None].swapaxes(-1, -2))
    scores = mx.maximum(scores, 0.0) * (indexer.head_dim**-0.5)
    scores = mx.sum(scores * weights[..., None], axis=2)
    # A query sees the groups that end at or before it: per row, (B, 1, 1).
    lens = ((positions + 1) // indexer.ratio).reshape(batch, 1, 1)
    visible = mx.arange(index_k.shape[1])[None, None, :] < lens
    scores = mx.where(visible, scores, -mx.inf)

    if indexer.is_candidate_source and indexer.candidate_topk_blocks > 0:
        candidates = _candidate_blocks(indexer, scores, lens)
    elif candidates is not None:
        scores = mx.where(candidates, scores, -mx.inf)

    k = min(indexer.index_topk, index_k.shape[1])
    chosen = mx.argpartition(-scores, k - 1, axis=-1)[..., :k].astype(mx.int32)
    return mx.where(chosen < lens, chosen, -1), candidates


def _candidate_blocks(indexer: Any, scores: mx.array, lens: mx.array) -> mx.array:
    """The candidate mask (B, 1, N) of the candidate source layer, per row."""
    batch, length, width = scores.shape
    block = indexer.candidate_block_size
    pad = (-width) % block
    padded = mx.pad(scores, [(0, 0), (0, 0), (0, pad)], constant_values=-mx.inf)
    block_scores = padded.reshape(batch, length, -1, block).max(axis=-1)
    # Always keep each row's newest block (only partly full).
    last = mx.where(lens > 0, (lens - 1) // block, -1)
    num_blocks = block_scores.shape[-1]
    block_scores = mx.where(mx.arange(num_blocks) == last, mx.inf, block_scores)
    k_blocks = min(indexer.candidate_topk_blocks, num_blocks)
    chosen = mx.argpartition(-block_scores, k_blocks - 1, axis=-1)[..., :k_blocks]
    reachable = mx.take_along_axis(block_scores, chosen, axis=-1) > -mx.inf
    candidates = mx.zeros(block_scores.shape, dtype=mx.bool_)
    candidates = mx.put_along_axis(candidates, chosen, reachable, axis=-1)
    return mx.repeat(candidates, block, axis=-1)[..., :width]
