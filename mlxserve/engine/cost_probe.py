"""Measure what one request's cache costs on the loaded model (rule 9 of docs/architecture.md).

The cost of a request's cache is measured, not guessed: `probe_cost` fills
real caches of the loaded model to a few lengths (alone and merged into a
decode batch) and `budget.fit_cost` turns those samples into a line

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
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxserve.cache.arrays import cache_arrays, cache_nbytes
from mlxserve.engine.budget import SLOPE_PERIOD, CacheCost, fit_cost
from mlxserve.engine.cost_store import CostStore
from mlxserve.models.gguf import cache_root
from mlxserve.models.loaded import LoadedModel, directory_signature

# Lengths the probe fills a cache to: just past 256-token preallocation blocks and just
# before power-of-two compression boundaries (a sliding window, if any, is added).
PROBE_LENGTHS = (1, 127, 255, 257, 511, 513)
MAX_PROBE_TOKENS = 8192


def probe_lengths(model_config: dict[str, Any]) -> list[int]:
    lengths = set(PROBE_LENGTHS)
    for key in ("sliding_window", "window_size"):
        value = model_config.get(key)
        if isinstance(value, int) and 0 < value < MAX_PROBE_TOKENS:
            lengths.add(value + 1)
            lengths.add(value + 1 + SLOPE_PERIOD)
    return sorted(lengths)


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
        samples[tokens] = max(samples.get(tokens, 0), cache_nbytes(cache))

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
    `QuantizedKVCache`, our `ChannelQuantizedKVCache`); else None.

    Those caches' bytes follow from their class (growth step, window) and the
    shape and dtype of what the model writes: its keys and values per token.
    The choice depends on the cache classes alone, so every rank of a
    distributed model makes the same one (their forwards meet in collectives).
    """
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    from mlxserve.models.channel_cache import ChannelQuantizedKVCache

    known = (KVCache, RotatingKVCache, QuantizedKVCache, ChannelQuantizedKVCache)
    if not cache or any(type(c) not in known for c in cache):
        return None
    return [_written_position(c) for c in cache]


def _written_position(cache: Any) -> tuple[mx.array, mx.array] | None:
    if (
        getattr(cache, "window_keys", None) is not None
    ):  # per-channel keys: its window is full precision
        return cache.window_keys[..., :1, :], cache.window_values[..., :1, :]
    if cache.keys is None:
        return None
    return _one_position(cache.keys, cache), _one_position(cache.values, cache)


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


# Costs measured in this process, by what they depend on (`checkpoint_key`): an engine
# that starts again on the same checkpoint (a restart after a failure, several servers
# in one process) does not measure again (on a pooled cache the probe runs forwards).
_MEASURED: dict[tuple[Any, ...], CacheCost] = {}
_MEASURED_LOCK = threading.Lock()


def checkpoint_key(model: LoadedModel, batchable: bool) -> tuple[Any, ...] | None:
    """What a model's cache cost depends on: its directory's files (name, size, mtime),
    its config, the classes that run it, its shard and its cache setting, and whether
    requests decode batched. None where the directory cannot be read (never reused)."""
    signature = directory_signature(model.path)
    if signature is None:
        return None
    module = getattr(model.model, "module", None)
    return (
        *signature,
        json.dumps(model.config, sort_keys=True, default=str),
        type(model.model).__qualname__,
        type(module).__qualname__,
        repr(model.extra.get("shard")),
        repr(model.extra.get("kv_quant")),
        batchable,
    )


def measured_once(
    model: LoadedModel, batchable: bool, measure: Callable[[], CacheCost]
) -> CacheCost:
    """`measure()`'s cost, or the one measured before for the same checkpoint and
    setting (`checkpoint_key`): in this process, else on disk (`cost_store`)."""
    key = checkpoint_key(model, batchable)
    if key is None:
        return measure()
    with _MEASURED_LOCK:
        known = _MEASURED.get(key)
    if known is not None:
        return known
    store = _store(model)
    cost = store.read(key) if store is not None else None
    if cost is None:
        cost = measure()
        if store is not None:
            store.write(key, cost)
    with _MEASURED_LOCK:
        _MEASURED[key] = cost
    return cost


def _store(model: LoadedModel) -> CostStore | None:
    """The disk store for a whole model; none for a distributed shard: every rank must
    make the same choice to measure (their probe forwards meet in collectives), and one
    rank's file could be there while another's is not."""
    if model.extra.get("shard") is not None:
        return None
    return CostStore(cache_root() / "costs")
