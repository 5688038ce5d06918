"""DeepSeek-V4 requests decode as one batch with the same greedy tokens as alone.

Each request is prefilled alone (as the engine does), its caches merged into
one batch (`DecodeBatch`, `models/dsv4_batch.py`), then all rows decode
together. Prompt lengths differ mod 4 and around 128, so rows complete their
ratio-4 and ratio-128 pooling windows at different decode steps; rows join
(`extend`) and leave (`filter`) mid-way; an extracted row decodes on alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from mlxserve.engine.runner import DecodeBatch, Runner
from mlxserve.models.dsv4_batch import BatchCarryingPoolingCache
from mlxserve.models.dsv4_overlap import CarryingPoolingCache
from mlxserve.models.generate import greedy_generate
from mlxserve.models.loaded import LoadedModel

STEPS = 14


@pytest.fixture(scope="module")
def model(model_dir_factory) -> LoadedModel:
    from mlxserve.models.load import load

    return load(model_dir_factory("deepseek_v4"))


def _prompt(length: int, seed: int) -> list[int]:
    return [(37 * seed + 11 * i) % 250 + 3 for i in range(length)]


def _argmax(logits: mx.array) -> list[int]:
    return [int(t) for t in mx.argmax(logits, axis=-1).tolist()]


def _prefill(model: LoadedModel, prompt: list[int]) -> tuple[list[Any], int]:
    cache = model.make_cache()
    logits = model.model.last_logits(mx.array([prompt], dtype=mx.int32), cache)
    return cache, _argmax(logits)[0]


def _expected(model: LoadedModel, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return {rid: greedy_generate(model, p, STEPS, stop_at_eos=False) for rid, p in prompts.items()}


def _step(model: LoadedModel, batch: DecodeBatch, outputs: dict[str, list[int]]) -> None:
    inputs = mx.array([[outputs[rid][-1]] for rid in batch.request_ids], dtype=mx.int32)
    tokens = _argmax(model.model.last_logits(inputs, batch.cache))
    for rid, token in zip(batch.request_ids, tokens, strict=True):
        outputs[rid].append(token)


def _join(model: LoadedModel, batch: DecodeBatch, outputs: dict, rid: str, prompt: list[int]):
    cache, first = _prefill(model, prompt)
    batch.add(rid, cache)
    outputs[rid] = [first]


def test_v4_caches_merge_into_one_batch(model: LoadedModel) -> None:
    assert Runner(model).batchable
    batch = DecodeBatch()
    _join(model, batch, {}, "a", _prompt(9, 1))
    kinds = {type(c).__name__ for layer in batch.cache for c in getattr(layer, "caches", [layer])}
    assert kinds == {"BatchRotatingKVCache", "BatchCarryingPoolingCache", "BatchPoolingCache"}


def test_merged_batch_matches_single_runs(model: LoadedModel) -> None:
    # Lengths cover every remainder mod 4, no complete window (3), and rows that
    # complete their first ratio-128 window during decode (125, 127).
    lengths = [3, 5, 10, 16, 23, 125, 127, 40]
    prompts = {f"r{i}": _prompt(n, i) for i, n in enumerate(lengths)}
    expected = _expected(model, prompts)
    batch = DecodeBatch()
    outputs: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        _join(model, batch, outputs, rid, prompt)
    for _ in range(STEPS - 1):
        _step(model, batch, outputs)
    assert outputs == expected


def test_rows_join_and_leave_mid_batch(model: LoadedModel) -> None:
    lengths = {"a": 6, "b": 13, "c": 4, "d": 30, "e": 126, "f": 2}
    prompts = {rid: _prompt(n, i + 7) for i, (rid, n) in enumerate(lengths.items())}
    expected = _expected(model, prompts)
    batch = DecodeBatch()
    outputs: dict[str, list[int]] = {}
    for rid in ("a", "b", "c"):
        _join(model, batch, outputs, rid, prompts[rid])
    joins = {3: ["d", "e"], 6: ["f"]}
    leaves = {5: {"b"}, 9: {"a", "e"}}
    for step in range(1, 24):
        for rid in joins.get(step, []):
            _join(model, batch, outputs, rid, prompts[rid])
        done = {r for r in batch.request_ids if len(outputs[r]) >= STEPS}
        batch.remove(leaves.get(step, set()) | done)
        if not batch.request_ids:
            break
        _step(model, batch, outputs)
    for rid, tokens in outputs.items():
        assert tokens == expected[rid][: len(tokens)], rid
    assert all(len(outputs[rid]) == STEPS for rid in ("c", "d", "f"))


def test_extracted_row_decodes_on_alone(model: LoadedModel) -> None:
    prompts = {"a": _prompt(7, 3), "b": _prompt(18, 4), "c": _prompt(2, 5)}
    expected = _expected(model, prompts)
    batch = DecodeBatch()
    outputs: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        _join(model, batch, outputs, rid, prompt)
    for _ in range(5):
        _step(model, batch, outputs)
    for row, rid in enumerate(batch.request_ids):
        cache = [layer.extract(row) for layer in batch.cache]
        pools = [c for layer in cache for c in getattr(layer, "caches", [])]
        carried = [c.carry_kv is not None for c in pools if isinstance(c, CarryingPoolingCache)]
        assert all(carried) == (len(prompts[rid]) + 5 >= 4), rid
        tokens = list(outputs[rid])
        while len(tokens) < STEPS:
            logits = model.model.last_logits(mx.array([[tokens[-1]]], dtype=mx.int32), cache)
            tokens.append(_argmax(logits)[0])
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
