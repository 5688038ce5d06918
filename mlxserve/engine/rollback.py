"""Cutting a cache back to the positions a verify forward keeps.

Plain KV caches are trimmed. DeepSeek-V4's caches (sliding windows that a
block of positions may rotate, and pooled windows that a block may complete)
cannot be trimmed: mlx-vlm's speculative cache transaction
(`start_speculative_cache`) records what the forward changed and, on commit,
keeps exactly the kept positions (windows are replayed, pools re-cut; our
carrying pools pick their carry from the kept windows, see
`models/dsv4_batch.py`). Other caches cannot be cut back, so their models do
not verify drafts.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import BatchKVCache, KVCache, trim_prompt_cache
from mlx_vlm.models.cache import PoolingCache, RotatingKVCache
from mlx_vlm.speculative.cache_state import iter_leaf_caches, start_speculative_cache

# Per-request cache types whose batched forms a transaction can cut back.
_TRANSACTED = (RotatingKVCache, PoolingCache)


def verify_rows_limit(probe: list[Any], batchable: bool) -> int | None:
    """How many rows of a batch may verify together for a model whose fresh cache is
    `probe`: any (None) for plain KV caches, 0 where nothing can be cut back.

    DeepSeek-V4's caches verify one row at a time: over a left-padded batch of
    several rows, a block of positions fed at once gave other tokens than the
    same positions fed one by one, so the verify would not be a plain run's."""
    if probe and all(type(layer) is KVCache for layer in probe):
        return None
    leaves = list(iter_leaf_caches(probe))
    transacted = batchable and bool(leaves) and all(isinstance(c, _TRANSACTED) for c in leaves)
    return 1 if transacted else 0


class CutBack:
    """One verify forward over `fed` positions per row; `keep` ends it."""

    def __init__(self, cache: list[Any], fed: int) -> None:
        self.cache = cache
        self.fed = fed
        plain = all(type(layer) in (KVCache, BatchKVCache) for layer in cache)
        self._transaction = None if plain else start_speculative_cache(cache, fed)

    def keep(self, kept: int, rows: int) -> None:
        """Keep the first `kept` fed positions of every row."""
        if self._transaction is None:
            trim_prompt_cache(self.cache, self.fed - kept)
        else:
            self._transaction.commit([kept] * rows)
