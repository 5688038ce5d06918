"""The memory probe's two ways of filling caches agree where both apply."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxserve.engine.cost_probe import probe_by_forwards, probe_by_writes, probe_cost, written_kv


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("batchable", [True, False])
def test_writes_measure_what_forwards_measure(family: str, batchable: bool, loaded_factory):
    model = loaded_factory(family)
    cache = model.make_cache()
    mx.eval(model.model.last_logits(mx.array([[3]], dtype=mx.int32), cache))
    written = written_kv(cache)
    assert written is not None and len(written) == len(cache)
    by_writes = probe_by_writes(model, batchable, written)
    assert by_writes == probe_by_forwards(model, batchable)
    assert by_writes.bytes_per_token > 0


def test_a_sliding_window_cache_is_measured_alike(swa_model_dir) -> None:
    from mlx_lm.models.cache import RotatingKVCache

    from mlxserve.models.load import load

    model = load(swa_model_dir)
    cache = model.make_cache()
    assert any(isinstance(c, RotatingKVCache) for c in cache)
    mx.eval(model.model.last_logits(mx.array([[3]], dtype=mx.int32), cache))
    written = written_kv(cache)
    assert written is not None
    assert probe_by_writes(model, True, written) == probe_by_forwards(model, True)


def test_caches_only_forwards_can_fill_are_probed_by_forwards(loaded_factory) -> None:
    model = loaded_factory("deepseek_v4")
    cache = model.make_cache()
    mx.eval(model.model.last_logits(mx.array([[3]], dtype=mx.int32), cache))
    assert written_kv(cache) is None
    assert probe_cost(model, batchable=True) == probe_by_forwards(model, batchable=True)
