"""The decode batch: requests decoding together over one batched cache.

A request's layer caches merge into the batch when their type has a batched
form: mlx-lm's plain and sliding-window KV caches (`BatchKVCache`,
`BatchRotatingKVCache`, left-padded), quantized KV caches
(`models/quantized_batch.py`), mlx-vlm's DeepSeek-V4 caches and
DeepSeek-V4.1's layer caches (see `models/deepseek_v4/batch.py`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxserve.cache.arrays import cache_arrays
from mlxserve.engine.sampling import PendingLogits, PendingSample
from mlxserve.models.channel_cache import BatchChannelQuantizedKVCache, ChannelQuantizedKVCache
from mlxserve.models.quantized_batch import BatchQuantizedKVCache, share_mask

# mlx-lm cache classes with a batched form (mlx-lm's own, or ours for quantized KV).
_LM_BATCHED: dict[type, Any] = {
    KVCache: BatchKVCache,
    RotatingKVCache: BatchRotatingKVCache,
    QuantizedKVCache: BatchQuantizedKVCache,
    ChannelQuantizedKVCache: BatchChannelQuantizedKVCache,
}


def mergeable(layer: Any) -> bool:
    if type(layer) in _LM_BATCHED:
        return True
    from mlxserve.models.deepseek_v4.batch import mergeable as model_mergeable

    return model_mergeable(layer)


def _merge_layer(layer: Any) -> Any:
    """One request's layer cache as a batch of one, chosen by cache type."""
    batched = _LM_BATCHED.get(type(layer))
    if batched is not None:
        return batched.merge([layer])
    from mlxserve.models.deepseek_v4.batch import merge_layer

    return merge_layer(layer)


@dataclass
class DecodeBatch:
    """Requests decoding together over one batched cache (row i = request_ids[i]).

    `ahead`: the next step, already fed to the cache: its tokens being drawn, or
    only its logits when its rows draw after reading this step's tokens (see
    `Runner._decode_rows`); rows leaving the batch leave it too.
    """

    request_ids: list[str] = field(default_factory=list)
    cache: list[Any] = field(default_factory=list)
    ahead: PendingSample | PendingLogits | None = None

    def add(self, request_id: str, cache: list[Any]) -> None:
        if self.ahead is not None:
            # The batch's cache is a step ahead of the newcomer's: it cannot line up.
            raise RuntimeError("a request cannot join while the next decode step is in flight")
        merged = [_merge_layer(layer) for layer in cache]
        if not self.request_ids:
            self.cache = merged
            share_mask(self.cache)
        else:
            for mine, theirs in zip(self.cache, merged, strict=True):
                mine.extend(theirs)
            _evaluate_held_arrays(self.cache)
        self.request_ids.append(request_id)

    def take_ahead(self, request_ids: list[str]) -> PendingSample | PendingLogits | None:
        """The step already in flight, if any, for exactly these rows."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and request_ids != self.request_ids:
            raise RuntimeError("decode batch out of step with the step in flight")
        return ahead

    def remove(self, request_ids: set[str]) -> None:
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in request_ids]
        if len(keep) == len(self.request_ids):
            return
        self.request_ids = [self.request_ids[i] for i in keep]
        if not keep:
            self.cache = []
            self.ahead = None
            return
        if self.ahead is not None:
            self.ahead = self.ahead.rows(keep)
        for layer in self.cache:
            layer.filter(keep)
        _evaluate_held_arrays(self.cache)


class DecodeMode(enum.Enum):
    """How a decode step's tokens are read (the three are greedy-identical)."""

    PLAIN = "plain"  # forward, then read the tokens
    AHEAD = "ahead"  # also start the next step's forward before reading them
    OVERLAP = "overlap"  # start the forward; read the tokens once the chunks' graphs are built


class DecodeTokens:
    """What reads this step's decode tokens: nothing, or an overlapped step's read.
    `read` may be called at every point the tokens could be needed; it reads once."""

    def __init__(self, read: Callable[[], None] | None = None) -> None:
        self._read = read

    def read(self) -> None:
        read, self._read = self._read, None
        if read is not None:
            read()


def _evaluate_held_arrays(layers: list[Any]) -> None:
    """Evaluate every array the batch's caches hold, bookkeeping included.

    `extend` and `filter` rebuild each array lazily from the one before. The
    forward evaluates what it reads, but a batched cache also keeps arrays it
    does not read every step (mlx-vlm's per-row lengths, paddings and offsets,
    the carried windows): those stayed lazy, and every join and every leave
    added to their graphs for as long as the batch lived, which under agents
    is forever. The graphs are native memory outside MLX's own counters:
    about 50 KB a request on the tiny DeepSeek-V4 (rule 15 of
    docs/architecture.md). Scheduled, not awaited: the next forward needs most
    of them anyway.
    """
    mx.async_eval(cache_arrays(layers))
