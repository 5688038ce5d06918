"""The disk tier's file format and codec: every cache type round-trips through a file
and continues exactly as the original; every kind of damage is a `CorruptEntry`.

Oracle: a cache written, read back and rebuilt (a slice of bytes at a time)
gives the same logits as the live cache it was copied from.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as lm_cache
import mlx_vlm.models.cache as vlm_cache
import pytest
from test_cache_snapshot import (
    CONTINUATION,
    MID_DECODE,
    PROMPT,
    Forward,
    assert_same_logits,
    feed,
    llama_forward,
    llama_model,
    mamba_forward,
    mamba_model,
    v4_forward,
    v4_model,
    v41_forward,
    v41_model,
)

from mlxserve.cache import copy_cache
from mlxserve.cache.codec import Restore, encode
from mlxserve.cache.disk_file import CorruptEntry, read_entry, read_manifest, write_entry
from mlxserve.cache.layers import layout_trimmable
from mlxserve.models.channel_cache import ChannelQuantizedKVCache

SIGNATURE = "ab" * 32


def _round_trip(tmp_path: Path, caches: list[Any], max_bytes: int = 512) -> list[Any]:
    encoded = encode(caches)
    path = tmp_path / "entry.safetensors"
    tokens = list(range(1, 6))
    size = write_entry(path, SIGNATURE, tokens, encoded.layout, encoded.tensors)
    assert path.stat().st_size == size
    manifest, tensors = read_entry(path)
    assert manifest.tokens == tokens and manifest.signature == SIGNATURE
    restore = Restore(manifest.layout, tensors)
    steps = 1
    while not restore.advance(max_bytes):
        steps += 1
    assert steps >= 2 or restore.nbytes <= max_bytes  # it came back in slices
    return restore.caches()


def _check(
    tmp_path: Path,
    forward: Forward,
    make: Callable[[], list[Any]],
    before: Sequence[Sequence[int]] = (PROMPT,),
) -> list[Any]:
    live = make()
    feed(forward, live, before)
    restored = _round_trip(tmp_path, copy_cache(live))
    assert [type(c) for c in restored] == [type(c) for c in live]
    expected = feed(forward, live, CONTINUATION)
    assert_same_logits(feed(forward, restored, CONTINUATION), expected)
    return restored


def test_plain_kv_round_trips_and_is_trimmable(tmp_path: Path) -> None:
    restored = _check(tmp_path, llama_forward, llama_model().make_cache)
    assert layout_trimmable(encode(restored).layout)


@pytest.mark.parametrize(
    "make",
    [
        lambda: [lm_cache.QuantizedKVCache(group_size=32, bits=8) for _ in range(2)],
        lambda: [lm_cache.RotatingKVCache(max_size=8) for _ in range(2)],
        lambda: [lm_cache.RotatingKVCache(max_size=64) for _ in range(2)],
        lambda: [vlm_cache.KVCache() for _ in range(2)],
        lambda: [vlm_cache.QuantizedKVCache(group_size=32, bits=8) for _ in range(2)],
        lambda: [vlm_cache.RotatingKVCache(max_size=8) for _ in range(2)],
        lambda: [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=8)],
        lambda: [ChannelQuantizedKVCache(group_size=32, bits=4) for _ in range(2)],
    ],
    ids=["lm-quant", "lm-rot8", "lm-rot64", "vlm-kv", "vlm-quant", "vlm-rot8", "mixed", "4-bit"],
)
def test_llama_cache_types_round_trip(tmp_path: Path, make: Callable[[], list[Any]]) -> None:
    _check(tmp_path, llama_forward, make, MID_DECODE)


def test_rotating_layout_is_not_trimmable(tmp_path: Path) -> None:
    live = [lm_cache.RotatingKVCache(max_size=8) for _ in range(2)]
    feed(llama_forward, live, [PROMPT])
    assert not layout_trimmable(encode(copy_cache(live)).layout)


def test_deepseek_v4_pooled_caches_round_trip(tmp_path: Path) -> None:
    restored = _check(tmp_path, v4_forward, v4_model().make_cache, MID_DECODE)
    assert any(isinstance(c, vlm_cache.CacheList) for c in restored)
    assert not layout_trimmable(encode(restored).layout)


def test_deepseek_v41_layer_caches_round_trip(tmp_path: Path) -> None:
    _check(tmp_path, v41_forward, v41_model().make_cache, MID_DECODE)


def test_recurrent_arrays_cache_round_trips(tmp_path: Path) -> None:
    _check(tmp_path, mamba_forward, mamba_model().make_cache)


def test_carrying_pooling_cache_round_trips(tmp_path: Path, loaded_factory) -> None:
    """The engine's DeepSeek-V4 caches (with the carried overlap window) come back whole."""
    from mlxserve.models.deepseek_v4.overlap import CarryingPoolingCache

    model = loaded_factory("deepseek_v4")

    def forward(tokens: mx.array, caches: list[Any]) -> mx.array:
        return model.model(tokens, cache=caches)

    restored = _check(tmp_path, forward, model.make_cache, MID_DECODE)
    carried = [
        sub
        for c in restored
        for sub in getattr(c, "caches", [])
        if isinstance(sub, CarryingPoolingCache)
    ]
    assert carried and any(c.carry_kv is not None for c in carried)


def test_bfloat16_bytes_survive(tmp_path: Path) -> None:
    cache = lm_cache.KVCache()
    keys = mx.random.normal((1, 2, 5, 8)).astype(mx.bfloat16)
    cache.update_and_fetch(keys, keys * 2)
    (restored,) = _round_trip(tmp_path, copy_cache([cache]), max_bytes=1)
    assert restored.keys.dtype == mx.bfloat16
    assert mx.array_equal(restored.keys, keys).item()
    assert mx.array_equal(restored.values, keys * 2).item()


def test_a_standard_safetensors_reader_reads_the_file(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors")
    live = llama_model().make_cache()
    feed(llama_forward, live, [PROMPT])
    encoded = encode(copy_cache(live))
    path = tmp_path / "e.safetensors"
    write_entry(path, SIGNATURE, [1, 2], encoded.layout, encoded.tensors)
    loaded = dict(safetensors.deserialize(path.read_bytes()))
    assert set(loaded) == {t.name for t in encoded.tensors}
    for t in encoded.tensors:
        assert bytes(loaded[t.name]["data"]) == bytes(t.data)


# -- damage ---------------------------------------------------------------------


@pytest.fixture
def entry_file(tmp_path: Path) -> Path:
    live = llama_model().make_cache()
    feed(llama_forward, live, [PROMPT])
    encoded = encode(copy_cache(live))
    path = tmp_path / "e.safetensors"
    write_entry(path, SIGNATURE, list(PROMPT), encoded.layout, encoded.tensors)
    return path


def _header_len(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_a_flipped_payload_byte_is_caught_on_read(entry_file: Path) -> None:
    data = bytearray(entry_file.read_bytes())
    data[_header_len(entry_file) + 100] ^= 0x01
    entry_file.write_bytes(bytes(data))
    read_manifest(entry_file)  # the header alone is intact
    with pytest.raises(CorruptEntry, match="payload checksum"):
        read_entry(entry_file)


def test_a_flipped_token_in_the_manifest_is_caught(entry_file: Path) -> None:
    data = entry_file.read_bytes()
    needle = json.dumps(PROMPT[:3], separators=(",", ":"))[1:-1].encode()
    at = data.index(needle)
    changed = data[:at] + b"9" + data[at + 1 :]
    entry_file.write_bytes(changed)
    with pytest.raises(CorruptEntry, match="manifest checksum"):
        read_manifest(entry_file)


@pytest.mark.parametrize("keep", [0, 5, 8, 200, -1])
def test_a_truncated_file_is_caught(entry_file: Path, keep: int) -> None:
    data = entry_file.read_bytes()
    entry_file.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(CorruptEntry):
        read_entry(entry_file)


def test_garbage_is_caught(entry_file: Path) -> None:
    entry_file.write_bytes(struct.pack("<Q", 4) + b"nope" + b"\0" * 64)
    with pytest.raises(CorruptEntry):
        read_manifest(entry_file)


def test_a_layout_that_does_not_build_is_a_value_error() -> None:
    restore = Restore([{"tag": "nobody.Cache", "meta": {}, "arrays": {}, "children": []}], {})
    assert restore.advance(1)
    with pytest.raises(ValueError, match="unknown cache class"):
        restore.caches()
