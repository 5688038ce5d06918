"""cache stage (see docs/architecture.md): snapshot copies of model caches and the prefix cache."""

from mlxserve.cache.prefix_cache import PrefixCache, PrefixCacheStats, PrefixHit
from mlxserve.cache.snapshot import (
    UnsupportedCacheError,
    cache_nbytes,
    cache_offset,
    copy_cache,
    is_trimmable,
    share_cache,
    tracked_offset,
    trim_cache,
)

__all__ = [
    "PrefixCache",
    "PrefixCacheStats",
    "PrefixHit",
    "UnsupportedCacheError",
    "cache_nbytes",
    "cache_offset",
    "copy_cache",
    "is_trimmable",
    "share_cache",
    "tracked_offset",
    "trim_cache",
]
