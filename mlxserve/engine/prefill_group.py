"""Prefill the whole prompts of several requests in one left-padded forward.

mlx-lm's `BatchKVCache` takes left-padded rows: row i's padding is masked and
its positions start at 0 after it, so each row computes what it would alone.
The runner groups the chunks that are a request's whole prompt on a fresh
plain-KV cache, full precision or quantized (over `BatchQuantizedKVCache`)
with no prefix-cache hit and nothing fed yet, the common case when several
short requests arrive together; each row's cache is then extracted
as the request's own and joins the decode batch at the next run like any
finished prefill. Padding is bounded: rows join a group only while the padded
forward stays within `MAX_PADDING` times the real tokens.

This module is the forward alone; the runner does the bookkeeping (samplers,
fault points per row, sampling, each row's own cache and snapshot), and falls
back to solo prefills when the forward raises, so a bad request fails alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from mlxserve.engine.plan import PrefillChunk
from mlxserve.models.channel_cache import BatchChannelQuantizedKVCache, ChannelQuantizedKVCache
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.quantized_batch import BatchQuantizedKVCache, share_mask

# Fresh per-request cache classes whose batched form a group prefills over.
GROUPABLE = (KVCache, QuantizedKVCache, ChannelQuantizedKVCache)


def _batched(fresh: Any, pads: list[int]) -> Any:
    if type(fresh) is QuantizedKVCache:
        return BatchQuantizedKVCache(pads, group_size=fresh.group_size, bits=fresh.bits)
    if type(fresh) is ChannelQuantizedKVCache:
        return BatchChannelQuantizedKVCache.padded(pads, fresh.group_size, fresh.bits)
    return BatchKVCache(pads)


# A group's padded forward feeds at most this many times its real tokens.
MAX_PADDING = 1.5


def pick_group(
    chunks: list[PrefillChunk], groupable: Callable[[PrefillChunk], bool]
) -> list[PrefillChunk]:
    """The groupable chunks to prefill together: longest first, padding bounded."""
    group: list[PrefillChunk] = []
    real = 0
    for chunk in sorted((c for c in chunks if groupable(c)), key=lambda c: -c.num_tokens):
        longest = group[0].num_tokens if group else chunk.num_tokens
        if (len(group) + 1) * longest > MAX_PADDING * (real + chunk.num_tokens):
            continue
        group.append(chunk)
        real += chunk.num_tokens
    return group


@dataclass
class GroupedPrefill:
    """One left-padded forward's last-position logits and its batched cache."""

    logits: mx.array
    cache: list[Any]
    fed_tokens: int  # padded width times rows: what the forward cost

    def row_cache(self, row: int) -> list[Any]:
        """Row `row`'s cache as a request's own (its padding dropped)."""
        return [layer.extract(row) for layer in self.cache]


def grouped_forward(model: LoadedModel, group: list[PrefillChunk]) -> GroupedPrefill:
    """One forward over the whole prompts of `group`, left-padded to the longest."""
    lengths = [c.num_tokens for c in group]
    width = max(lengths)
    pads = [width - n for n in lengths]
    rows = [[0] * pad + c.request.context_ids[: c.end] for pad, c in zip(pads, group, strict=True)]
    cache: list[Any] = [_batched(fresh, pads) for fresh in model.make_cache()]
    share_mask(cache)
    logits = model.model.last_logits(mx.array(rows, dtype=mx.int32), cache)
    return GroupedPrefill(logits, cache, width * len(group))
