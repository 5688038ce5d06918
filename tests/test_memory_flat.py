"""Nothing a request allocates outlives it: the native side.

Two leaks that neither Python's `gc` nor MLX's own counters see; glibc's
`mallinfo2` (bytes in use, less what MLX's arrays and buffer cache hold) does:
- `mx.compile` keeps one entry per distinct input shape of a compiled helper,
  forever, and DeepSeek-V4's helpers (mlx-vlm) compile per shape, so every new
  prefill length left ~100 KB behind;
- the decode batch's bookkeeping arrays grew lazy graphs with every join and
  leave, for as long as the batch lived (about 50 KB a request under agents).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable

import mlx.core as mx
import pytest

from mlxserve.models.loaded import LoadedModel


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _native_bytes_probe() -> Callable[[], int] | None:
    """Bytes malloc has handed out and not had back, less MLX's arrays and buffer cache."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2

    def native_bytes() -> int:
        gc.collect()
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd - mx.get_active_memory() - mx.get_cache_memory())

    return native_bytes


def test_prefills_of_new_lengths_leave_no_native_memory_behind(loaded_factory) -> None:
    """Forty prefills, each of a length not seen before, as agents' turns are: before
    the fix they kept ~4 MB (one compiled entry per length per helper); now ~0."""
    native_bytes = _native_bytes_probe()
    if native_bytes is None:
        pytest.skip("glibc's mallinfo2 is not available here")
    loaded: LoadedModel = loaded_factory("deepseek_v4")

    def prefill(length: int) -> None:
        cache = loaded.make_cache()
        tokens = mx.arange(length, dtype=mx.int32)[None] % 200 + 3
        mx.eval(loaded.model.last_logits(tokens, cache))

    for _ in range(2):  # allocator pools and the decode-sized compiled entries settle
        prefill(24)
        mx.eval(loaded.model.last_logits(mx.array([[5]], dtype=mx.int32), loaded.make_cache()))
    before = native_bytes()
    for length in range(25, 65):
        prefill(length)
    grown = native_bytes() - before
    assert grown < 1_500_000, f"{grown / 2**20:.2f} MB of native memory kept by 40 prefills"


def test_joins_and_leaves_of_a_live_batch_leave_no_native_memory_behind(loaded_factory) -> None:
    """Under agents the decode batch never empties: requests join and leave it for
    days. Each `extend` and `filter` rebuilt the batched caches' bookkeeping arrays
    lazily from the ones before, and the graphs grew for as long as the batch lived."""
    from mlxserve.cache.snapshot import copy_cache
    from mlxserve.engine.decode_batch import DecodeBatch

    native_bytes = _native_bytes_probe()
    if native_bytes is None:
        pytest.skip("glibc's mallinfo2 is not available here")
    loaded: LoadedModel = loaded_factory("deepseek_v4")
    prompt = loaded.make_cache()
    mx.eval(loaded.model.last_logits(mx.arange(3, 23, dtype=mx.int32)[None], prompt))
    batch = DecodeBatch()

    def cycle(n: int, first: int) -> None:
        for i in range(first, first + n):
            batch.add(f"r{i}", copy_cache(prompt))
            if len(batch.request_ids) > 3:
                batch.remove({batch.request_ids[0]})

    cycle(10, 0)
    before = native_bytes()
    cycle(150, 10)
    mx.eval([a for layer in batch.cache for a in layer.state if isinstance(a, mx.array)])
    grown = native_bytes() - before
    assert grown < 1_000_000, f"{grown / 2**20:.2f} MB of native memory kept by 150 joins"
