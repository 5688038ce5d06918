"""Cutting a cache back to the positions a verify forward keeps.

Plain KV caches are trimmed. DeepSeek-V4's caches (sliding windows that a
block of positions may rotate, and pooled windows that a block may complete)
cannot be trimmed: mlx-vlm's speculative cache transaction
(`start_speculative_cache`) records what the forward changed and, on commit,
keeps exactly the kept positions (windows are replayed, pools re-cut; our
carrying pools pick their carry from the kept windows, see
`models/deepseek_v4/batch.py`). DeepSeek-V4.1's layer caches have no transaction,
and their batched form decodes one token per row (`models/deepseek_v4/v41_batch.py`):
a verify extracts the row as mlx-lm's own `LayerCache`, feeds it the block,
and, when a draft is rejected, puts the state from before the block back and
feeds the kept positions again (`_Replay`). Other caches cannot be cut back,
so their models do not verify drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, trim_prompt_cache
from mlx_lm.models.deepseek_v41 import LayerCache
from mlx_vlm.models.cache import PoolingCache, RotatingKVCache
from mlx_vlm.speculative.cache_state import iter_leaf_caches, start_speculative_cache

from mlxserve.models.channel_cache import BatchChannelQuantizedKVCache, ChannelQuantizedKVCache
from mlxserve.models.deepseek_v4.v41_cache import BatchLayerCache
from mlxserve.models.quantized_batch import BatchQuantizedKVCache

# Plain KV caches (full precision or quantized), alone or batched: trimmed. (Keys quantized
# per channel are cut back exactly by up to `group_size` positions, more than any verify
# feeds: `config.MAX_DRAFT_TOKENS` is 16 and group sizes start at 32.)
_TRIMMED = (
    KVCache,
    QuantizedKVCache,
    BatchKVCache,
    BatchQuantizedKVCache,
    ChannelQuantizedKVCache,
    BatchChannelQuantizedKVCache,
)

# Per-request cache types whose batched forms a transaction can cut back.
_TRANSACTED = (RotatingKVCache, PoolingCache)

# Feeds (B, L) tokens to a cache (the model's forward; its logits are not read).
Replay = Callable[[mx.array, list[Any]], Any]


def verify_rows_limit(probe: list[Any], batchable: bool) -> int | None:
    """How many rows of a batch may verify together for a model whose fresh cache is
    `probe`: any (None) for plain KV caches, 0 where nothing can be cut back.

    DeepSeek-V4's caches verify one row at a time: over a left-padded batch of
    several rows, a block of positions fed at once gave other tokens than the
    same positions fed one by one, so the verify would not be a plain run's.
    V4.1's batched layer caches take one token per row, so a verify takes the
    batch's one row out (`_Replay`)."""
    if probe and all(type(layer) in _TRIMMED for layer in probe):
        return None
    if batchable and probe and all(type(layer) is LayerCache for layer in probe):
        return 1
    leaves = list(iter_leaf_caches(probe))
    transacted = batchable and bool(leaves) and all(isinstance(c, _TRANSACTED) for c in leaves)
    return 1 if transacted else 0


class _Replay:
    """A batch of one V4.1 row, verified over its own `LayerCache`s.

    mlx-lm's `LayerCache` replaces its arrays, never writes into them, so the
    state before the verify is a shallow copy of each cache's fields."""

    def __init__(self, batch: list[BatchLayerCache]) -> None:
        if any(layer.size != 1 for layer in batch):
            raise ValueError("V4.1 layer caches verify one row at a time")
        self.batch = batch
        self.rows = [layer.extract(0) for layer in batch]
        self.before = [dict(row.__dict__) for row in self.rows]

    def keep(self, kept: int, inputs: mx.array, replay: Replay) -> None:
        if kept < inputs.shape[1]:
            for row, before in zip(self.rows, self.before, strict=True):
                row.__dict__.update(before)
            replay(inputs[:, :kept], self.rows)
        for layer, row in zip(self.batch, self.rows, strict=True):
            layer.assign([row])


class CutBack:
    """One verify forward of `inputs` (B, fed) over `self.cache`; `keep` ends it."""

    def __init__(self, cache: list[Any], inputs: mx.array, replay: Replay) -> None:
        self.fed = int(inputs.shape[1])
        self.cache = cache
        self._inputs, self._replay = inputs, replay
        self._rows: _Replay | None = None
        self._transaction = None
        if cache and all(isinstance(layer, BatchLayerCache) for layer in cache):
            self._rows = _Replay(cache)
            self.cache = list(self._rows.rows)
        elif not all(type(layer) in _TRIMMED for layer in cache):
            self._transaction = start_speculative_cache(cache, self.fed)

    def keep(self, kept: int, rows: int) -> None:
        """Keep the first `kept` fed positions of every row."""
        if self._rows is not None:
            self._rows.keep(kept, self._inputs, self._replay)
        elif self._transaction is None:
            trim_prompt_cache(self.cache, self.fed - kept)
        else:
            self._transaction.commit([kept] * rows)
