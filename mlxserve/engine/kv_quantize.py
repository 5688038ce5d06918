"""The runner's side of a quantized KV cache (`--kv-cache-bits`, `--kv-quantize-after`).

With `quantize_after` 0 (the default) a request's cache is quantized from its
first token (`models/quantized_cache.apply_kv_quant` makes it so), and nothing
here changes it. With `quantize_after` N, a request prefills over a
full-precision cache until it holds N tokens; its cache is quantized at the
end of the first chunk that reaches N, or when it joins the decode batch,
whichever comes first: the rows of one batch decode over one cache type.
As with mlx-lm's `--quantized-kv-start`, where chunks end then decides which
positions were computed against full-precision keys.

The memory probe measures both forms: a request may hold N tokens in full
precision, and while its cache is quantized both copies exist.

A prefill forward over a quantized cache holds its attention scores whole:
mlx-lm's quantized attention multiplies by the codes with `mx.quantized_matmul`
and has no fused kernel, where full-precision attention on Metal does (the
reason a quantized cache can peak above a bf16 one, mlx-lm #1587). So a long
chunk is fed in pieces (`prefill_rows`) whose scores stay under half the
quantized cache's own bytes at that context (or `SCORE_FLOOR_BYTES`, where
that is more: at short contexts an extra forward costs more than the scores);
each position computes exactly what it would in one forward.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxserve.engine.budget import CacheCost
from mlxserve.engine.cost_probe import probe_cost
from mlxserve.engine.plan import PrefillChunk
from mlxserve.kv_quant import KVQuant
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.quantized_cache import quantize_layers

# Scores and their softmax, float32: bytes per (row, query head, key) of a piece.
SCORE_BYTES = 8
SCORE_SHARE = 0.5
SCORE_FLOOR_BYTES = 256 << 20
MIN_PIECE_ROWS = 16


def prefill_rows(query_heads: int, cache_bytes_per_token: float, context: int) -> int:
    """The most positions one prefill forward over a quantized cache of `context`
    tokens may feed (see the module docstring)."""
    per_row = max(1, query_heads) * max(1, context) * SCORE_BYTES
    allowed = max(SCORE_SHARE * cache_bytes_per_token * context, SCORE_FLOOR_BYTES)
    return max(MIN_PIECE_ROWS, int(allowed // per_row))


def leading_pieces(
    chunk: PrefillChunk, spec: KVQuant | None, cost: CacheCost | None, query_heads: int
) -> list[tuple[int, int]]:
    """The pieces of `chunk` to feed before its last one (none: it goes in one forward)."""
    if spec is None or cost is None:
        return []
    rows = prefill_rows(query_heads, cost.bytes_per_token, chunk.end)
    return [(s, min(s + rows, chunk.end)) for s in range(chunk.start, chunk.end, rows)][:-1]


def kv_quant_of(model: LoadedModel) -> KVQuant | None:
    spec = model.extra.get("kv_quant")
    return spec if isinstance(spec, KVQuant) else None


def settle(cache: list[Any], spec: KVQuant | None, tokens: int, joining: bool) -> None:
    """Quantize a request's cache in place once it holds `quantize_after` tokens, or
    as it joins the decode batch (no-op where it is quantized already)."""
    if spec is None or spec.quantize_after == 0:
        return
    if joining or tokens >= spec.quantize_after:
        cache[:] = quantize_layers(cache, spec)


def quantized_probe_cost(model: LoadedModel, batchable: bool, spec: KVQuant) -> CacheCost:
    """One request's cache bytes against its tokens, quantized after `spec.quantize_after`.

    The line of the quantized cache, raised by what the full-precision cache
    of `quantize_after` tokens holds (it lives until the quantized copy is made)."""

    def quantized_cache() -> list[Any]:
        return quantize_layers(model.make_cache(), spec)

    quantized = probe_cost(replace(model, make_cache=quantized_cache), batchable)
    full = probe_cost(model, batchable)
    head = full.row(spec.quantize_after)
    return CacheCost(quantized.fixed_bytes + head, quantized.bytes_per_token)
