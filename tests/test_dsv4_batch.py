"""DeepSeek-V4 requests decode as one batch with the same greedy tokens as alone.

Each request is prefilled alone (as the engine does), its caches merged into
one batch (`DecodeBatch`, `models/dsv4_batch.py`), then all rows decode
together. Prompt lengths differ mod 4 and around 128, so rows complete their
ratio-4 and ratio-128 pooling windows at different decode steps; rows join
(`extend`) and leave (`filter`) mid-way; an extracted row decodes on alone.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from batch_helpers import (
    STEPS,
    argmax,
    check_rows_join_and_leave,
    decode_together,
    join,
    prompt_ids,
    solo_tokens,
    step,
)

from mlxserve.engine.decode_batch import DecodeBatch
from mlxserve.engine.runner import Runner
from mlxserve.models.deepseek_v4.batch import BatchCarryingPoolingCache
from mlxserve.models.deepseek_v4.overlap import CarryingPoolingCache
from mlxserve.models.loaded import LoadedModel


@pytest.fixture(scope="module")
def model(model_dir_factory) -> LoadedModel:
    from mlxserve.models.load import load

    return load(model_dir_factory("deepseek_v4"))


def test_v4_caches_merge_into_one_batch(model: LoadedModel) -> None:
    assert Runner(model).batchable
    batch = DecodeBatch()
    join(model, batch, {}, "a", prompt_ids(9, 1))
    kinds = {type(c).__name__ for layer in batch.cache for c in getattr(layer, "caches", [layer])}
    assert kinds == {"BatchRotatingKVCache", "BatchCarryingPoolingCache", "BatchPoolingCache"}


def test_merged_batch_matches_single_runs(model: LoadedModel) -> None:
    # Lengths cover every remainder mod 4, no complete window (3), and rows that
    # complete their first ratio-128 window during decode (125, 127).
    lengths = [3, 5, 10, 16, 23, 125, 127, 40]
    prompts = {f"r{i}": prompt_ids(n, i) for i, n in enumerate(lengths)}
    assert decode_together(model, prompts) == solo_tokens(model, prompts)


def test_rows_join_and_leave_mid_batch(model: LoadedModel) -> None:
    check_rows_join_and_leave(model, {"a": 6, "b": 13, "c": 4, "d": 30, "e": 126, "f": 2})


def test_extracted_row_decodes_on_alone(model: LoadedModel) -> None:
    prompts = {"a": prompt_ids(7, 3), "b": prompt_ids(18, 4), "c": prompt_ids(2, 5)}
    expected = solo_tokens(model, prompts)
    batch = DecodeBatch()
    outputs: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        join(model, batch, outputs, rid, prompt)
    for _ in range(5):
        step(model, batch, outputs)
    for row, rid in enumerate(batch.request_ids):
        cache = [layer.extract(row) for layer in batch.cache]
        pools = [c for layer in cache for c in getattr(layer, "caches", [])]
        carried = [c.carry_kv is not None for c in pools if isinstance(c, CarryingPoolingCache)]
        assert all(carried) == (len(prompts[rid]) + 5 >= 4), rid
        tokens = list(outputs[rid])
        while len(tokens) < STEPS:
            logits = model.model.last_logits(mx.array([[tokens[-1]]], dtype=mx.int32), cache)
            tokens.append(argmax(logits)[0])
        assert tokens == expected[rid], rid


def test_carry_survives_filter_and_extend() -> None:
    ratio, width = 4, 6
    caches = []
    for i in range(3):
        cache = CarryingPoolingCache(ratio)
        if i != 1:
            cache.carry_kv = mx.full((1, ratio, width), float(i + 1))
            cache.carry_gate = mx.full((1, ratio, width), float(i + 10))
        caches.append(cache)
    merged = BatchCarryingPoolingCache.merge(caches)
    assert merged.has_carry == [True, False, True]
    assert merged.carry_gate is not None and merged.carry_gate[1].tolist()[0][0] == -float("inf")
    merged.filter([2, 1])
    assert merged.has_carry == [True, False]
    merged.extend(BatchCarryingPoolingCache.merge([CarryingPoolingCache(ratio)]))
    assert merged.has_carry == [True, False, False]
    assert merged.carry_kv is not None and merged.carry_kv.shape == (3, ratio, width)
    first = merged.extract(0)
    assert first.carry_kv is not None and first.carry_kv.tolist()[0][0][0] == 3.0
    assert merged.extract(1).carry_kv is None
