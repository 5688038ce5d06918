"""KV memory accounting: bytes per token measured on the loaded model, one byte budget.

The engine admits a request only when its cache fits (rule 9 of docs/architecture.md). The
cost of a request's cache is measured, not guessed: `Runner.probe_cost` fills
real caches of the loaded model to a few lengths (alone and merged into a
decode batch) and `fit_cost` turns those samples into a line

    bytes(n tokens) <= fixed_bytes + bytes_per_token * n

that lies above every sample. The slope is the growth between the two longest
probes, so for pooled/compressed and sliding-window caches it is their real
asymptotic growth; the intercept covers preallocation slack (mlx-lm's KV
caches grow in blocks of 256 tokens) and whatever does not grow.

Plain and sliding-window KV caches (mlx-lm's `KVCache`, `RotatingKVCache`)
hold what their class allocates for the keys and values the model writes, so
after one real forward (which shows those shapes) the probe fills them by
their own `update_and_fetch` instead of by forwards: a few milliseconds in
place of a prefill of every probe length (minutes for a 135M model on the CPU
backend). Other caches are filled by forwards.

Rows of a decode batch are left-padded to the longest row, so a batch costs
`rows * row(longest)`; requests that decode alone cost `sum(row(n))`.

`live_nbytes` measures what caches really hold (batched cache classes
included), so tests and `bench memory` can check the budget is never passed.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxserve.models.loaded import LoadedModel

if TYPE_CHECKING:
    from mlxserve.engine.kv_pool import KVPool

logger = logging.getLogger(__name__)

# Lengths the probe fills a cache to: just past 256-token preallocation blocks and just
# before power-of-two compression boundaries (a sliding window, if any, is added).
PROBE_LENGTHS = (1, 127, 255, 257, 511, 513)
MAX_PROBE_TOKENS = 8192
SLOPE_PERIOD = 256
# Held back from the device's memory besides the weights (activations, the allocator's cache).
MARGIN_FRACTION = 0.10
MIN_MARGIN_BYTES = 1 << 30
_CACHE_MODULES = ("mlx_lm.models", "mlx_vlm.models", "mlxserve.models")


@dataclass(frozen=True)
class CacheCost:
    """An upper bound on one request's cache bytes as a function of the tokens it holds."""

    fixed_bytes: int
    bytes_per_token: float

    def row(self, tokens: int) -> int:
        return self.fixed_bytes + math.ceil(self.bytes_per_token * max(tokens, 0))

    def total(self, lengths: Sequence[int], batched: bool) -> int:
        """Bytes of these requests' caches: one left-padded batch, or each alone."""
        if not lengths:
            return 0
        if batched:
            return len(lengths) * self.row(max(lengths))
        return sum(self.row(n) for n in lengths)


def fit_cost(samples: Iterable[tuple[int, int]]) -> CacheCost:
    """The line above every (tokens, bytes) sample.

    Its slope is the largest growth between samples a whole number of
    `SLOPE_PERIOD` tokens apart (mlx-lm preallocates KV in 256-token blocks and
    compressed caches compact at power-of-two boundaries, so closer samples can
    jump by a whole block); its intercept is the largest remainder.
    """
    points = sorted(set(samples))
    if not points:
        raise ValueError("no samples")
    slopes = [
        (b2 - b1) / (n2 - n1)
        for i, (n1, b1) in enumerate(points)
        for n2, b2 in points[i + 1 :]
        if (n2 - n1) % SLOPE_PERIOD == 0
    ]
    if not slopes:  # too few probes: the steepest growth between any two
        slopes = [
            (b2 - b1) / (n2 - n1)
            for i, (n1, b1) in enumerate(points)
            for n2, b2 in points[i + 1 :]
            if n2 > n1
        ]
    slope = max([0.0, *slopes])
    if len(points) == 1:
        tokens, nbytes = points[0]
        slope = nbytes / max(tokens, 1)
    fixed = max(math.ceil(b - slope * n) for n, b in points)
    # One token more: a batch's buffer may hold one row past the longest request's.
    return CacheCost(max(0, fixed) + math.ceil(slope), slope)


def probe_lengths(model_config: dict[str, Any]) -> list[int]:
    lengths = set(PROBE_LENGTHS)
    for key in ("sliding_window", "window_size"):
        value = model_config.get(key)
        if isinstance(value, int) and 0 < value < MAX_PROBE_TOKENS:
            lengths.add(value + 1)
            lengths.add(value + 1 + SLOPE_PERIOD)
    return sorted(lengths)


def cache_arrays(caches: Iterable[Any]) -> list[mx.array]:
    """Every mx.array reachable from these cache objects, each once.

    Walks the attributes of cache objects of mlx-lm, mlx-vlm and mlxserve
    classes (batched forms, CacheList nesting), lists and tuples.
    """
    seen: dict[int, mx.array] = {}
    stack: list[tuple[Any, int]] = [(c, 0) for c in caches]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, mx.array):
            seen.setdefault(id(item), item)
        elif depth > 8:
            continue
        elif isinstance(item, list | tuple):
            stack.extend((x, depth + 1) for x in item)
        elif type(item).__module__.startswith(_CACHE_MODULES) and hasattr(item, "__dict__"):
            stack.extend((x, depth + 1) for x in vars(item).values())
    return list(seen.values())


def live_nbytes(caches: Iterable[Any]) -> int:
    """Bytes the arrays of these cache objects hold (see `cache_arrays`)."""
    return sum(a.nbytes for a in cache_arrays(caches))


def weights_nbytes(module: Any) -> int:
    """Bytes of a model's parameters (0 where they cannot be read)."""
    from mlx.utils import tree_flatten

    parameters = getattr(module, "parameters", None)
    if parameters is None:
        return 0
    leaves: list[tuple[str, Any]] = tree_flatten(parameters())  # type: ignore[assignment]
    return sum(v.nbytes for _, v in leaves if isinstance(v, mx.array))


def device_memory_bytes() -> int:
    """Metal's recommended working set, or physical RAM elsewhere."""
    try:
        if mx.metal.is_available():
            info = mx.metal.device_info()
            size = info.get("max_recommended_working_set_size") or info.get("memory_size")
            if isinstance(size, int) and size > 0:
                return size
    except (AttributeError, RuntimeError):
        logger.debug("no Metal device info; using physical RAM")
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def default_kv_budget(weights_bytes: int, device_bytes: int | None = None) -> int:
    """The device's memory minus the weights and a margin (at least 64 MiB)."""
    device = device_memory_bytes() if device_bytes is None else device_bytes
    margin = max(MIN_MARGIN_BYTES, int(device * MARGIN_FRACTION))
    return max(64 << 20, device - weights_bytes - margin)


@dataclass(frozen=True)
class KVBudget:
    """The engine's byte budget and what one request's cache costs on this model.

    With a `pool` (several models in one server) the budget is the pool's,
    shared with the other engines; `member` names this engine in it.
    """

    budget_bytes: int
    cost: CacheCost
    batched: bool
    pool: KVPool | None = None
    member: str = ""

    def total(self, lengths: Sequence[int]) -> int:
        return self.cost.total(lengths, self.batched)

    @property
    def whole_bytes(self) -> int:
        """The whole budget (the shared pool's, with several models)."""
        return self.budget_bytes if self.pool is None else self.pool.total_bytes

    def room(self) -> int:
        """Bytes this engine's caches may take: the budget less other models' holdings."""
        return self.budget_bytes if self.pool is None else self.pool.room(self.member)

    def prefix_room(self) -> int:
        """`room`, less what other models wait for: a prefix cache gives way first."""
        return self.budget_bytes if self.pool is None else self.pool.prefix_room(self.member)

    def claim(self, nbytes: int) -> bool:
        """Whether caches of `nbytes` fit (in a shared pool, taken from it at once)."""
        if self.pool is None:
            return nbytes <= self.budget_bytes
        return self.pool.claim(self.member, nbytes)

    def publish(self, held: int, waiting_for: int) -> None:
        """Tell a shared pool what this engine holds, and what its head waits for (0: none)."""
        if self.pool is not None:
            self.pool.hold(self.member, held)
            self.pool.want(self.member, waiting_for)


# Tokens the memory probe decodes after each prefill (caches allocate on the first decodes).
PROBE_DECODE_STEPS = 4


def probe_cost(model: LoadedModel, batchable: bool) -> CacheCost:
    """Measure one request's cache bytes against its tokens on this model.

    One real forward writes a token into fresh caches. Where every layer's
    cache is one whose bytes follow from the shapes written into it (see
    `probe_by_writes`), the probe goes on by writes of those shapes;
    otherwise by forwards (`probe_by_forwards`). Both sample the same
    lengths, alone and merged into a batch, and fit the same bound.
    """
    first = model.make_cache()
    mx.eval(model.model.last_logits(mx.array([[_probe_token(0, model)]], dtype=mx.int32), first))
    written = written_kv(first)
    if written is not None:
        return probe_by_writes(model, batchable, written)
    return probe_by_forwards(model, batchable)


def _probe_token(i: int, model: LoadedModel) -> int:
    return (i * 31 + 7) % max(1, model.vocab_size)


# The probe's schedule at each length: a prefill (one multi-token update, which may hold
# more than decoding does, e.g. a whole chunk in a window cache), PROBE_DECODE_STEPS decode
# steps alone, then, when requests decode batched, the cache merged into a batch of one
# and PROBE_DECODE_STEPS // 2 steps more. `feed(n, cache)` advances `cache` by n tokens.
def _probe_schedule(
    model: LoadedModel, batchable: bool, feed: Callable[[int, list[Any]], None]
) -> CacheCost:
    from mlxserve.engine.decode_batch import DecodeBatch

    samples: dict[int, int] = {}

    def sample(tokens: int, cache: list[Any]) -> None:
        samples[tokens] = max(samples.get(tokens, 0), live_nbytes(cache))

    for length in probe_lengths(model.config):
        cache = model.make_cache()
        feed(length, cache)
        sample(length, cache)
        for step in range(1, PROBE_DECODE_STEPS + 1):
            feed(1, cache)
            sample(length + step, cache)
        if batchable:
            probe = DecodeBatch()
            probe.add("probe", cache)
            length += PROBE_DECODE_STEPS
            sample(length, probe.cache)
            for step in range(1, PROBE_DECODE_STEPS // 2 + 1):
                feed(1, probe.cache)
                sample(length + step, probe.cache)
    return fit_cost(samples.items())


def probe_by_forwards(model: LoadedModel, batchable: bool) -> CacheCost:
    """The probe's schedule run by forwards of the model (any cache class).

    It costs a prefill of every probe length (about 1,700 tokens), so it is kept
    for caches whose bytes depend on more than the shapes written into them
    (pooled, compressed, DeepSeek-V4.1 layer caches).
    """
    counter = iter(range(1 << 62))

    def feed(n: int, cache: list[Any]) -> None:
        tokens = [_probe_token(next(counter), model) for _ in range(n)]
        mx.eval(model.model.last_logits(mx.array([tokens], dtype=mx.int32), cache))

    return _probe_schedule(model, batchable, feed)


# Per layer: the keys and values one token adds, as the model wrote them (batch 1, 1 position);
# None for a layer this process holds a cache for but does not run (a distributed shard).
WrittenKV = list[tuple[mx.array, mx.array] | None]


def written_kv(cache: list[Any]) -> WrittenKV | None:
    """What one real forward wrote into each layer, if every layer is a plain,
    sliding-window or quantized KV cache (mlx-lm's `KVCache`, `RotatingKVCache`,
    `QuantizedKVCache`); else None.

    Those caches' bytes follow from their class (growth step, window) and the
    shape and dtype of what the model writes: its keys and values per token.
    The choice depends on the cache classes alone, so every rank of a
    distributed model makes the same one (their forwards meet in collectives).
    """
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    if not cache or any(type(c) not in (KVCache, RotatingKVCache, QuantizedKVCache) for c in cache):
        return None
    return [
        None if c.keys is None else (_one_position(c.keys, c), _one_position(c.values, c))
        for c in cache
    ]


def _one_position(written: Any, cache: Any) -> mx.array:
    """One position of what the model wrote: as it is, or, for a quantized cache
    (which keeps only codes, scales and biases), zeros of the width and dtype the
    codes stand for (a cache's bytes do not depend on the values written)."""
    bits = getattr(cache, "bits", None)
    if bits is None:
        return written[..., :1, :]
    codes, scales, _ = written
    width = codes.shape[-1] * 32 // bits
    return mx.zeros((*codes.shape[:2], 1, width), dtype=scales.dtype)


def probe_by_writes(model: LoadedModel, batchable: bool, written: WrittenKV) -> CacheCost:
    """The probe's schedule run by the caches' own `update_and_fetch`, fed what the model
    writes (`written_kv`), in place of forwards: the same cache objects, the same calls
    the attention makes, the same samples, at the cost of a few allocations (a forward
    per token on this model would take minutes of prefill to learn the same bytes)."""

    def feed(n: int, cache: list[Any]) -> None:
        for layer, kv in zip(cache, written, strict=True):
            if kv is None:
                continue
            keys, values = kv
            grow = (*keys.shape[:2], n, keys.shape[3]), (*values.shape[:2], n, values.shape[3])
            layer.update_and_fetch(mx.broadcast_to(keys, grow[0]), mx.broadcast_to(values, grow[1]))
        mx.eval(cache_arrays(cache))

    return _probe_schedule(model, batchable, feed)
