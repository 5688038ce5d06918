"""The 4-bit KV cache with keys quantized per channel (`models/channel_cache.py`).

Checked on random keys, values and queries against a reference built from the
definition: positions of earlier groups read quantized (keys per channel,
values per position after the Hadamard rotation), a query's own group read in
full precision. The engine-level parity (alone, batched, RAM hit, disk
restore) is in `test_kv_quant.py`.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxserve.cache.layers import layout_trim_step
from mlxserve.cache.prefix_cache import PrefixCache
from mlxserve.cache.snapshot import copy_cache, trim_step
from mlxserve.models.channel_attention import channel_attention, rotate
from mlxserve.models.channel_cache import BatchChannelQuantizedKVCache, ChannelQuantizedKVCache

G = 32
KV_HEADS, REPEATS, DIM, LENGTH = 2, 3, 64, 150
SCALE = DIM**-0.5


@pytest.fixture(scope="module")
def qkv() -> tuple[mx.array, mx.array, mx.array]:
    key = mx.random.key(3)
    k1, k2, k3 = mx.random.split(key, 3)
    keys = mx.random.normal((1, KV_HEADS, LENGTH, DIM), key=k1)
    values = mx.random.normal((1, KV_HEADS, LENGTH, DIM), key=k2)
    queries = mx.random.normal((1, KV_HEADS * REPEATS, LENGTH, DIM), key=k3)
    return keys, values, queries


def _fed(qkv, pieces: list[tuple[int, int]]) -> tuple[mx.array, ChannelQuantizedKVCache]:
    """Attention outputs of positions fed in these pieces, and the cache they leave."""
    keys, values, queries = qkv
    cache = ChannelQuantizedKVCache(G, 4)
    outs = []
    for a, b in pieces:
        fetched, _ = cache.update_and_fetch(keys[:, :, a:b], values[:, :, a:b])
        outs.append(channel_attention(queries[:, :, a:b], fetched, SCALE))
    return mx.concatenate(outs, axis=2), cache


def _quantized_dequantized(x: mx.array, axis_groups_along_positions: bool) -> mx.array:
    if axis_groups_along_positions:
        t = x.swapaxes(-1, -2)
        return mx.dequantize(*mx.quantize(t, group_size=G, bits=4), group_size=G, bits=4).swapaxes(
            -1, -2
        )
    r = mx.dequantize(*mx.quantize(rotate(x, G), group_size=G, bits=4), group_size=G, bits=4)
    return rotate(r, G)


def _reference(qkv) -> mx.array:
    """The definition, in float32: earlier groups from dequantized codes, the own group
    from the full-precision keys and values."""
    keys, values, queries = qkv
    whole = LENGTH // G * G
    kq = _quantized_dequantized(keys[:, :, :whole], True)
    vq = _quantized_dequantized(values[:, :, :whole], False)
    pad = [(0, 0), (0, 0), (0, LENGTH - whole), (0, 0)]
    kq, vq = mx.pad(kq, pad), mx.pad(vq, pad)
    expand = [mx.repeat(x, REPEATS, axis=1) for x in (keys, values, kq, vq)]
    k, v, kq, vq = expand
    pos = mx.arange(LENGTH)[:, None]
    col = mx.arange(LENGTH)[None]
    own = (col <= pos) & (col >= pos // G * G)
    earlier = col < pos // G * G
    fp_scores = (queries * SCALE) @ k.swapaxes(-1, -2)
    q_scores = (queries * SCALE) @ kq.swapaxes(-1, -2)
    scores = mx.where(own, fp_scores, mx.where(earlier, q_scores, -mx.inf))
    weights = mx.softmax(scores, axis=-1)
    return mx.where(own, weights, 0) @ v + mx.where(earlier, weights, 0) @ vq


def test_the_rotation_preserves_scores_and_outputs_in_float() -> None:
    """H is orthonormal and its own inverse, per group of channels: q·k is unchanged
    when both are rotated, and attention over rotated values, rotated back, is the same."""
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((2, 5, 128), key=k1)
    k = mx.random.normal((2, 7, 128), key=k2)
    v = mx.random.normal((2, 7, 128), key=k3)
    for group in (32, 64, 128):
        assert mx.allclose(rotate(rotate(k, group), group), k, atol=1e-5).item()
        scores = q @ k.swapaxes(-1, -2)
        rotated = rotate(q, group) @ rotate(k, group).swapaxes(-1, -2)
        assert mx.allclose(scores, rotated, atol=1e-4).item()
        weights = mx.softmax(scores, axis=-1)
        out = rotate(weights @ rotate(v, group), group)
        assert mx.allclose(out, weights @ v, atol=1e-5).item()
    # Per group: the first 32 channels never mix with the others.
    x = mx.concatenate([mx.ones((1, 32)), mx.zeros((1, 96))], axis=-1)
    assert mx.all(rotate(x, 32)[:, 32:] == 0).item()


def test_attention_follows_the_definition(qkv) -> None:
    out, cache = _fed(qkv, [(0, LENGTH)])
    assert cache.offset == LENGTH and cache.window_start == [LENGTH // G * G - G]
    assert cache.keys is not None and cache.keys[0].dtype == mx.uint32
    assert mx.allclose(out, _reference(qkv), atol=1e-4).item()


def test_any_chunking_computes_the_same(qkv) -> None:
    """Each query reads earlier groups quantized and its own in full precision, however
    the positions arrived: one forward, uneven pieces, one at a time."""
    whole, _ = _fed(qkv, [(0, LENGTH)])
    pieces = [(0, 40), (40, 41), (41, 64), (64, 100)] + [(i, i + 1) for i in range(100, LENGTH)]
    pieced, _ = _fed(qkv, pieces)
    assert mx.array_equal(whole, pieced).item()


def test_batch_rows_decode_as_their_single_caches(qkv) -> None:
    """Rows of different lengths merged, extended, stepped across group boundaries,
    filtered and extracted: each computes what its own cache does."""
    keys, values, queries = qkv
    lengths = [37, 5, 64]
    singles = [_fed(qkv, [(0, n)])[1] for n in lengths]
    batch = BatchChannelQuantizedKVCache.merge([_fed(qkv, [(0, lengths[0])])[1]])
    for n in lengths[1:]:
        batch.extend(BatchChannelQuantizedKVCache.merge([_fed(qkv, [(0, n)])[1]]))
    for step in range(40):
        at = [n + step for n in lengths]
        k = mx.stack([keys[0, :, p] for p in at])[:, :, None]
        v = mx.stack([values[0, :, p] for p in at])[:, :, None]
        q = mx.stack([queries[0, :, p] for p in at])[:, :, None]
        fetched, _ = batch.update_and_fetch(k, v)
        together = channel_attention(q, fetched, SCALE)
        for row, single in enumerate(singles):
            mine, _ = single.update_and_fetch(k[row : row + 1], v[row : row + 1])
            alone = channel_attention(q[row : row + 1], mine, SCALE)
            assert mx.allclose(together[row], alone[0], atol=1e-5).item()
    batch.filter([2, 0])
    assert batch.lengths == [104, 77]
    row = batch.extract(0)
    assert row.offset == singles[2].offset == 104
    for mine, theirs in zip(row.keys or (), singles[2].keys or (), strict=True):
        width = mine.shape[-1]
        assert mx.array_equal(mine, theirs[..., :width]).item()


def test_cut_back_is_exact_within_the_window_or_to_a_group(qkv) -> None:
    keys, values, queries = qkv
    reference, _ = _fed(qkv, [(0, LENGTH)])
    # 70 held (groups 0 and 1 complete): cut back 8 reopens group 1, kept in the window.
    _, cache = _fed(qkv, [(0, 70)])
    assert cache.trim(8) == 8 and cache.offset == 62
    fetched, _ = cache.update_and_fetch(keys[:, :, 62:66], values[:, :, 62:66])
    again = channel_attention(queries[:, :, 62:66], fetched, SCALE)
    assert mx.array_equal(again, reference[:, :, 62:66]).item()
    # To a group boundary below the window: exact too (nothing of it is in full precision).
    _, cache = _fed(qkv, [(0, 140)])
    cache.trim(140 - G)
    fetched, _ = cache.update_and_fetch(keys[:, :, G:LENGTH], values[:, :, G:LENGTH])
    assert mx.array_equal(
        channel_attention(queries[:, :, G:], fetched, SCALE), reference[:, :, G:]
    ).item()
    # Anywhere else the cut group's keys would be needed in full precision.
    _, cache = _fed(qkv, [(0, 140)])
    with pytest.raises(ValueError, match="whole groups"):
        cache.trim(100)


def test_snapshots_carry_the_layout_and_trim_to_a_group(qkv) -> None:
    """A copy restores what it held; the prefix cache reuses a longer entry cut back to
    a multiple of the group size, which then computes what a fresh cache does."""
    keys, values, queries = qkv
    reference, _ = _fed(qkv, [(0, LENGTH)])
    _, cache = _fed(qkv, [(0, 100)])
    (copied,) = copy_cache([cache])
    assert type(copied) is ChannelQuantizedKVCache and copied.offset == 100
    assert trim_step([copied]) == G
    fetched, _ = copied.update_and_fetch(keys[:, :, 100:], values[:, :, 100:])
    assert mx.array_equal(
        channel_attention(queries[:, :, 100:], fetched, SCALE), reference[:, :, 100:]
    ).item()
    from mlxserve.cache.codec import cache_layout

    assert layout_trim_step(cache_layout([cache])) == G
    store = PrefixCache(1 << 30, 8)
    ids = list(range(1000, 1100))
    assert store.insert(ids, [cache])
    hit = store.lookup(ids[:70] + [7, 8, 9])
    assert hit is not None and hit.key_len == 2 * G  # 70 shared, cut back to 64
    (reused,) = hit.cache
    fetched, _ = reused.update_and_fetch(keys[:, :, 2 * G :], values[:, :, 2 * G :])
    out = channel_attention(queries[:, :, 2 * G :], fetched, SCALE)
    assert mx.array_equal(out, reference[:, :, 2 * G :]).item()
