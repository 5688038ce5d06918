"""copy_cache / share_cache / cache_nbytes / is_trimmable / cache_offset on every
supported cache type.

Oracle: continuing generation from a copy gives the same logits as continuing
from the original, even after the original has been written to in place; a
copy scheduled without waiting reads the values of the moment it was made; and
continuing from shared handles leaves the snapshot as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as lm_cache
import mlx_vlm.models.cache as vlm_cache
import pytest
from mlx_lm.models import deepseek_v41, llama, mamba

from mlxserve.cache import (
    UnsupportedCacheError,
    cache_nbytes,
    cache_offset,
    copy_cache,
    is_trimmable,
    share_cache,
    trim_cache,
)

Forward = Callable[[mx.array, list[Any]], mx.array]

PROMPT = [(7 * i + 3) % 251 + 1 for i in range(42)]
# Continuation: a multi-token chunk, then single-token decode steps (the
# rotating cache has separate code paths for both), crossing pool boundaries.
CONTINUATION = [[11, 12, 13, 14, 15], [16], [17], [18], [19], [20], [21], [22]]


@functools.cache
def llama_model() -> llama.Model:
    mx.random.seed(1)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        vocab_size=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@functools.cache
def v4_model() -> Any:
    from mlx_vlm.models.deepseek_v4 import Model, ModelConfig

    mx.random.seed(2)
    config = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        head_dim=32,
        compress_ratios=[0, 4, 128, 4],
        hc_mult=2,
        hc_sinkhorn_iters=3,
        num_hash_layers=1,
        sliding_window=16,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        index_block=4,
        index_keep=2,
    )
    lm = Model(config).language_model
    mx.eval(lm.parameters())
    return lm


@functools.cache
def v41_model() -> deepseek_v41.Model:
    mx.random.seed(3)
    args = deepseek_v41.ModelArgs(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        o_groups=2,
        o_lora_rank=32,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        compress_ratios=(0, 4, 4, 4),
        kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 3),
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        rms_norm_eps=1e-6,
    )
    model = deepseek_v41.Model(args)
    mx.eval(model.parameters())
    return model


@functools.cache
def mamba_model() -> mamba.Model:
    mx.random.seed(4)
    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    model = mamba.Model(args)
    mx.eval(model.parameters())
    return model


def llama_forward(tokens: mx.array, caches: list[Any]) -> mx.array:
    return llama_model()(tokens, cache=caches)


def v4_forward(tokens: mx.array, caches: list[Any]) -> mx.array:
    return v4_model()(tokens, cache=caches).logits


def v41_forward(tokens: mx.array, caches: list[Any]) -> mx.array:
    return v41_model()(tokens, cache=caches)


def mamba_forward(tokens: mx.array, caches: list[Any]) -> mx.array:
    return mamba_model()(tokens, cache=caches)


def feed(forward: Forward, caches: list[Any], chunks: Sequence[Sequence[int]]) -> list[mx.array]:
    """Feed each chunk; return the last-position logits after each."""
    out = []
    for chunk in chunks:
        logits = forward(mx.array([list(chunk)]), caches)[:, -1, :]
        mx.eval(logits)
        out.append(logits)
    return out


def assert_same_logits(a: list[mx.array], b: list[mx.array]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert mx.array_equal(x, y).item(), f"logits differ at step {step}"


def _layer_types(caches: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for c in caches:
        if isinstance(c, lm_cache.CacheList | vlm_cache.CacheList):
            out.append((type(c), _layer_types(c.caches)))
        else:
            out.append(type(c))
    return out


MID_DECODE = [PROMPT, [1], [2], [3]]


def check_continues_identically(
    forward: Forward, make: Callable[[], list[Any]], before: Sequence[Sequence[int]] = (PROMPT,)
) -> list[Any]:
    """Feed `before`, copy, keep writing into the original, then continue the copy."""
    live = make()
    feed(forward, live, before)
    snap = copy_cache(live, wait=False)  # scheduled; the writes below come after it
    assert _layer_types(snap) == _layer_types(live)
    assert cache_offset(snap) == cache_offset(live) == sum(len(c) for c in before)
    nbytes = cache_nbytes(snap)
    assert 0 < nbytes <= cache_nbytes(live)

    expected = feed(forward, live, CONTINUATION)  # writes into live in place
    assert cache_nbytes(snap) == nbytes
    reuse_1 = copy_cache(snap)
    reuse_2 = copy_cache(snap)
    assert_same_logits(feed(forward, reuse_1, CONTINUATION), expected)
    # The snapshot itself was untouched by the first reuse.
    assert_same_logits(feed(forward, reuse_2, CONTINUATION), expected)
    # Shared handles (a prefix-cache hit) write through to nothing they share.
    for _ in range(2):
        shared = share_cache(snap)
        assert _layer_types(shared) == _layer_types(snap)
        assert_same_logits(feed(forward, shared, CONTINUATION), expected)
    assert cache_nbytes(snap) == nbytes
    return snap


def test_llama_kv_cache_continues_identically() -> None:
    snap = check_continues_identically(llama_forward, llama_model().make_cache)
    assert all(type(c) is lm_cache.KVCache for c in snap)
    # Only the used rows are kept, not the 256-row step allocation.
    assert all(c.keys.shape[2] == len(PROMPT) for c in snap)
    assert is_trimmable(snap)


def test_llama_quantized_kv_cache_continues_identically() -> None:
    def make() -> list[Any]:
        return [lm_cache.QuantizedKVCache(group_size=32, bits=8) for _ in range(2)]

    snap = check_continues_identically(llama_forward, make)
    assert all(c.keys[0].shape[2] == len(PROMPT) for c in snap)
    assert is_trimmable(snap)


def test_kv_to_quantized_then_copy() -> None:
    live = llama_model().make_cache()
    feed(llama_forward, live, [PROMPT])
    quant = [c.to_quantized(group_size=32, bits=8) for c in live]
    expected = feed(llama_forward, copy_cache(quant), CONTINUATION)
    assert_same_logits(feed(llama_forward, quant, CONTINUATION), expected)


@pytest.mark.parametrize("max_size", [8, 64])
def test_llama_rotating_kv_cache_continues_identically(max_size: int) -> None:
    def make() -> list[Any]:
        return [lm_cache.RotatingKVCache(max_size=max_size) for _ in range(2)]

    snap = check_continues_identically(llama_forward, make)
    assert not is_trimmable(snap)


@pytest.mark.parametrize(
    "make",
    [
        lambda: [vlm_cache.KVCache() for _ in range(2)],
        lambda: [vlm_cache.QuantizedKVCache(group_size=32, bits=8) for _ in range(2)],
        lambda: [vlm_cache.RotatingKVCache(max_size=8) for _ in range(2)],
        lambda: [vlm_cache.RotatingKVCache(max_size=64) for _ in range(2)],
    ],
    ids=["kv", "quantized", "rotating-wrapped", "rotating-unfilled"],
)
def test_llama_with_vlm_caches_continues_identically(make: Callable[[], list[Any]]) -> None:
    check_continues_identically(llama_forward, make)


@pytest.mark.parametrize("cls", [lm_cache.RotatingKVCache, vlm_cache.RotatingKVCache])
def test_rotating_copy_mid_rotation_continues_identically(cls: type) -> None:
    # Decode steps after the window filled: the write index is mid-buffer.
    check_continues_identically(
        llama_forward, lambda: [cls(max_size=8) for _ in range(2)], MID_DECODE
    )


def test_deepseek_v4_copy_mid_decode_continues_identically() -> None:
    check_continues_identically(v4_forward, v4_model().make_cache, MID_DECODE)


def test_deepseek_v41_copy_mid_decode_continues_identically() -> None:
    check_continues_identically(v41_forward, v41_model().make_cache, MID_DECODE)


def test_rotating_copy_before_first_wrap_drops_slack() -> None:
    live = [lm_cache.RotatingKVCache(max_size=64) for _ in range(2)]
    feed(llama_forward, live, [PROMPT[:3], [5], [6]])  # in-place path preallocates
    assert live[0].keys.shape[2] > 5
    snap = copy_cache(live)
    assert snap[0].keys.shape[2] == 5
    expected = feed(llama_forward, live, CONTINUATION)
    assert_same_logits(feed(llama_forward, snap, CONTINUATION), expected)


def test_deepseek_v4_window_and_pooled_caches_continue_identically() -> None:
    snap = check_continues_identically(v4_forward, v4_model().make_cache)
    assert type(snap[0]) is vlm_cache.RotatingKVCache
    pooled = [sub for c in snap[1:] for sub in c.caches if type(sub) is vlm_cache.PoolingCache]
    assert pooled and any(p.pooled is not None for p in pooled)
    assert any(p.remainder > 0 for p in pooled)  # 42 tokens: an open group of 2
    assert not is_trimmable(snap)


def test_deepseek_v41_layer_cache_continues_identically() -> None:
    snap = check_continues_identically(v41_forward, v41_model().make_cache)
    assert all(type(c) is deepseek_v41.LayerCache for c in snap)
    assert snap[1].compress_kv is not None and snap[1].index_k is not None
    assert snap[1].pending_kv is not None and snap[1].pending_kv.shape[1] == 2
    assert not is_trimmable(snap)


def test_mamba_arrays_cache_continues_identically() -> None:
    live = mamba_model().make_cache()
    feed(mamba_forward, live, [PROMPT])
    snap = copy_cache(live)
    assert all(type(c) is lm_cache.ArraysCache for c in snap)
    expected = feed(mamba_forward, live, CONTINUATION)
    assert_same_logits(feed(mamba_forward, snap, CONTINUATION), expected)
    assert not is_trimmable(snap)
    with pytest.raises(UnsupportedCacheError, match="offset"):
        cache_offset(snap)


def test_copy_survives_in_place_writes_and_owns_its_memory() -> None:
    live = llama_model().make_cache()
    feed(llama_forward, live, [PROMPT])
    before = [(mx.array(c.keys[..., : c.offset, :]), c.offset) for c in live]
    mx.eval([b for b, _ in before])
    mem0 = mx.get_active_memory()
    snap = copy_cache(live)
    assert mx.get_active_memory() - mem0 >= cache_nbytes(snap)
    for c in live:  # write into the live buffer exactly as KVCache does
        c.keys[..., 0 : c.offset, :] = mx.full(c.keys[..., 0 : c.offset, :].shape, 7.0)
        mx.eval(c.keys)
    for c, (keys, offset) in zip(snap, before, strict=True):
        assert c.offset == offset
        assert mx.array_equal(c.keys, keys).item()


def _kv(cache: Any, n: int, seed: int) -> list[mx.array]:
    mx.random.seed(seed)
    k, v = mx.random.normal((1, 1, n, 32)), mx.random.normal((1, 1, n, 32))
    return list(cache.update_and_fetch(k, v))


def test_nbytes_of_nested_cache_lists_is_sum_of_arrays() -> None:
    kv, rot, inner_kv = lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=4), lm_cache.KVCache()
    _kv(kv, 3, 0)
    _kv(rot, 6, 1)
    _kv(inner_kv, 2, 2)
    arrays = lm_cache.ArraysCache(2)
    arrays[0] = mx.ones((1, 3, 5))
    nested = lm_cache.CacheList(lm_cache.CacheList(kv, lm_cache.CacheList(inner_kv)), rot)
    caches = [nested, arrays]
    expected = (
        sum(
            a.nbytes
            for a in (kv.keys, kv.values, inner_kv.keys, inner_kv.values, rot.keys, rot.values)
        )
        + arrays[0].nbytes
    )
    assert cache_nbytes(caches) == expected

    snap = copy_cache(caches)
    assert _layer_types(snap) == _layer_types(caches)
    snap_kv = snap[0].caches[0].caches[0]
    assert snap_kv.keys.shape[2] == 3
    used = 2 * (3 + 2) * 32 * 4 + rot.keys.nbytes + rot.values.nbytes + arrays[0].nbytes
    assert cache_nbytes(snap) == used
    assert cache_offset(snap) == 3
    assert not is_trimmable(snap)  # a rotating cache inside


def test_vlm_nested_cache_list_and_pooling_nbytes() -> None:
    pool = vlm_cache.PoolingCache(4)
    mx.random.seed(5)
    pool.accumulate_windows(mx.random.normal((1, 6, 8)), mx.random.normal((1, 6, 8)), 0)
    pool.update_and_fetch(mx.random.normal((1, 1, 8)))
    rot = vlm_cache.RotatingKVCache(max_size=4)
    _kv(rot, 6, 6)
    caches = [vlm_cache.CacheList(vlm_cache.CacheList(rot), pool)]
    expected = rot.keys.nbytes + rot.values.nbytes + pool.buf_kv.nbytes
    expected += pool.buf_gate.nbytes + pool.pooled.nbytes
    assert cache_nbytes(caches) == expected
    snap = copy_cache(caches)
    assert cache_nbytes(snap) == expected
    assert cache_offset(snap) == 6
    assert cache_offset([vlm_cache.CacheList(pool)]) == 4 * 1 + 2
    assert not is_trimmable(snap)


def test_trim_kv_cache_then_copy_compacts() -> None:
    live = llama_model().make_cache()
    feed(llama_forward, live, [PROMPT])
    snap = copy_cache(live)
    assert trim_cache(snap, 10) == 10
    assert cache_offset(snap) == len(PROMPT) - 10
    compact = copy_cache(snap)
    assert all(c.keys.shape[2] == len(PROMPT) - 10 for c in compact)

    fresh = llama_model().make_cache()
    feed(llama_forward, fresh, [PROMPT[:-10]])
    tail = [PROMPT[-10:], *CONTINUATION]
    assert_same_logits(feed(llama_forward, compact, tail), feed(llama_forward, fresh, tail))


def test_trim_refuses_untrimmable() -> None:
    caches = [lm_cache.RotatingKVCache(max_size=64)]
    _kv(caches[0], 3, 7)
    assert caches[0].is_trimmable()  # mlx-lm says yes before the window fills
    assert not is_trimmable(caches)  # we never do
    with pytest.raises(ValueError, match="not trimmable"):
        trim_cache(caches, 1)
    assert not is_trimmable([])


class _Unknown:
    keys = None


class _SubKV(lm_cache.KVCache):
    pass


@pytest.mark.parametrize("cache", [_Unknown(), _SubKV(), lm_cache.ChunkedKVCache(8)])
def test_unknown_cache_type_raises(cache: Any) -> None:
    nested = [lm_cache.CacheList(lm_cache.KVCache(), cache)]
    for fn in (copy_cache, is_trimmable, cache_offset):
        with pytest.raises(UnsupportedCacheError, match=type(cache).__name__):
            fn([cache])
    with pytest.raises(UnsupportedCacheError, match=type(cache).__name__):
        copy_cache(nested)


def test_empty_caches_copy() -> None:
    caches = [lm_cache.KVCache(), vlm_cache.PoolingCache(4), deepseek_v41.LayerCache(16)]
    snap = copy_cache(caches)
    assert cache_nbytes(snap) == 0
    assert cache_offset(snap) == 0
    assert copy_cache([]) == [] and cache_offset([]) == 0
