"""DeepSeek-V4.1 requests decode as one batch with the same greedy tokens as alone.

Each request is prefilled alone (as the engine does), its `LayerCache`s merged
into one batch (`DecodeBatch` -> `models/dsv41_cache.BatchLayerCache`), then
all rows decode together, each at its own position
(`models/dsv41_batch.py`). Prompt lengths differ mod 4 and around the
16-token sliding window, so rows close their ratio-4 groups and fill their
windows at different steps; rows join (`extend`) and leave (`filter`)
mid-way; an extracted row decodes on alone.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import mlx.core as mx
import pytest
from batch_helpers import (
    STEPS,
    argmax,
    check_rows_join_and_leave,
    decode_together,
    join,
    prefill,
    prompt_ids,
    solo_tokens,
    step,
)
from engine_helpers import run_requests, tokens_of

from mlxserve.config import EngineConfig
from mlxserve.engine.decode_batch import DecodeBatch
from mlxserve.engine.request import SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.models.deepseek_v4.v41_cache import BatchLayerCache, RowBuffer
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel


@pytest.fixture(scope="module")
def model(model_dir_factory) -> LoadedModel:
    return load(model_dir_factory("deepseek_v41"))


@pytest.fixture(scope="module")
def candidate_model(model_dir_factory, tmp_path_factory) -> LoadedModel:
    """Index layers after a candidate source (the published V4.1 layout has one).

    Candidate blocks cover at least `index_topk` entries (2 x 4 >= 4; the
    published config: 2048 x 8 >= 512), so the top-k never has to pick among
    candidate-masked ties, whose order a batch cannot reproduce.
    """
    from mlxserve.models.tiny.synthetic import random_weights

    out = tmp_path_factory.mktemp("v41-candidates")
    shutil.copytree(model_dir_factory("deepseek_v41"), out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config.update(
        compress_ratios=[0, 4, 4, 4],
        kv_source_layer_ids=[1],
        index_source_layer_ids=[1, 3],
        candidate_source_layer_id=1,
        candidate_topk_blocks=2,
        candidate_block_size=4,
    )
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), random_weights(config, 5))
    return load(out)


def test_v41_caches_merge_into_one_batch(model: LoadedModel) -> None:
    assert Runner(model).batchable
    batch = DecodeBatch()
    join(model, batch, {}, "a", prompt_ids(9, 1))
    assert {type(layer) for layer in batch.cache} == {BatchLayerCache}


def test_merged_batch_matches_single_runs(model: LoadedModel) -> None:
    # Every remainder mod 4, no closed group yet (1, 3), windows not yet full
    # (< 16), just full (15, 16, 17) and long past it (40, 63).
    lengths = [1, 3, 5, 10, 15, 16, 17, 40, 63, 22]
    prompts = {f"r{i}": prompt_ids(n, i) for i, n in enumerate(lengths)}
    assert decode_together(model, prompts) == solo_tokens(model, prompts)


def test_candidate_blocks_per_row(candidate_model: LoadedModel) -> None:
    # 9+ index keys (36+ tokens) make more than two candidate blocks.
    lengths = [2, 7, 21, 38, 45, 60]
    prompts = {f"r{i}": prompt_ids(n, i + 3) for i, n in enumerate(lengths)}
    expected = solo_tokens(candidate_model, prompts)
    assert decode_together(candidate_model, prompts) == expected


def test_rows_join_and_leave_mid_batch(model: LoadedModel) -> None:
    check_rows_join_and_leave(model, {"a": 6, "b": 13, "c": 4, "d": 30, "e": 19, "f": 2})


def test_extracted_row_is_the_single_run_cache(model: LoadedModel) -> None:
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
        # The same request alone: its prompt, then the same tokens one at a time.
        alone, _ = prefill(model, prompts[rid])
        for token in outputs[rid][:-1]:
            mx.eval(model.model.last_logits(mx.array([[token]], dtype=mx.int32), alone))
        fed = prompts[rid] + outputs[rid][:-1]
        for mine, theirs in zip(cache, alone, strict=True):
            assert mine.offset == theirs.offset == len(fed)
            for name in ("window", "compress_kv", "index_k", "pending_kv", "pending_gate"):
                a, b = getattr(mine, name), getattr(theirs, name)
                assert (a is None) == (b is None), (rid, name)
                if a is not None and b is not None:
                    assert a.shape == b.shape, (rid, name)
                    # A batched matmul and a single-row one differ in float noise only.
                    assert mx.allclose(a, b, atol=1e-3).item(), (rid, name)
        tokens = list(outputs[rid])
        while len(tokens) < STEPS:
            logits = model.model.last_logits(mx.array([[tokens[-1]]], dtype=mx.int32), cache)
            tokens.append(argmax(logits)[0])
        assert tokens == expected[rid], rid


def test_row_buffer_keeps_rows_apart() -> None:
    rows = [mx.ones((1, 2, 3)), None, mx.full((1, 1, 3), 2.0)]
    buffer = RowBuffer.merge(rows)
    assert buffer.lengths == [2, 0, 1]
    buffer.put(mx.full((3, 1, 3), 5.0), advance=[True, False, True])
    assert buffer.lengths == [3, 0, 2]
    view = buffer.view()
    assert view is not None and view.shape == (3, 3, 3)
    assert view[0, 2, 0].item() == 5.0 and view[2, :2, 0].tolist() == [2.0, 5.0]
    buffer.filter([2, 1])
    buffer.extend(RowBuffer.merge([None]))
    assert buffer.lengths == [2, 0, 0]
    assert buffer.extract(1, keep_empty=False) is None
    empty = buffer.extract(1, keep_empty=True)
    assert empty is not None and empty.shape == (1, 0, 3)
    first = buffer.extract(0, keep_empty=False)
    assert first is not None and first[0, :, 0].tolist() == [2.0, 5.0]


def test_batch_bytes_are_counted_and_within_the_probed_cost(model: LoadedModel) -> None:
    from mlxserve.cache.arrays import cache_nbytes

    cost = Runner(model).probe_cost()
    batch = DecodeBatch()
    outputs: dict[str, list[int]] = {}
    lengths = {"a": 30, "b": 5, "c": 18, "d": 3}
    for i, (rid, n) in enumerate(lengths.items()):
        join(model, batch, outputs, rid, prompt_ids(n, i))
    for number in range(1, 10):
        step(model, batch, outputs)
        live = cache_nbytes(batch.cache)
        assert live == sum(layer.nbytes for layer in batch.cache) > 0
        tokens = [lengths[rid] + number for rid in batch.request_ids]
        assert live <= cost.total(tokens, batched=True), number
        if number == 5:
            batch.remove({"a"})


def test_engine_batches_v41_requests_like_single_runs(model_dir_factory) -> None:
    path = model_dir_factory("deepseek_v41")
    model = load(path)
    prompts = [prompt_ids(n, i) for i, n in enumerate([3, 17, 40, 9, 25, 5])]
    max_tokens = [6, 9, 4, 12, 7, 10]
    expected = [greedy_generate(model, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    jobs = [
        (p, SamplingParams(max_tokens=n), 0.01 * i)
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    # Chunked prefill (16-token chunks) while other rows decode.
    config = EngineConfig(max_prefill_tokens=16, prefix_cache=False)
    results = run_requests(config, lambda: load(path), jobs)
    assert [tokens_of(events) for events in results] == expected


# -- the NaN logits of the old synthetic V4.1 config ---------------------------------


def _reads(config: dict[str, Any], layer: int) -> tuple[int | None, int | None]:
    """(layer whose compressed KV this layer attends to, layer whose top-k it uses)."""
    kv, index = config["kv_source_layer_ids"], config["index_source_layer_ids"]
    ratios = config["compress_ratios"]
    sources = [j for j in range(layer + 1) if j in kv and ratios[j]]
    pickers = [j for j in range(layer + 1) if j in index]
    return (sources[-1] if sources else None), (pickers[-1] if pickers else None)


@pytest.mark.parametrize("layers", [2, 4, 8])
def test_synthetic_v41_picks_index_entries_of_their_own_ratio(layers: int) -> None:
    """A layer's top-k picks must index the compressed KV it attends to.

    mlx-lm 0.32.2 gathers the picked rows without a bounds check. The old
    config (ratios 0/4/128/4, index sources only at ratio 4) had the ratio-128
    layer use ratio-4 picks: from 128 tokens on it read past its one entry,
    and the logits came out NaN at some lengths (garbage memory, so not at
    every length). Our config's fault, not mlx-lm's math.
    """
    from mlxserve.models.tiny.synthetic import build_config

    config = build_config("deepseek_v41", layers=layers)
    ratios = config["compress_ratios"]
    for layer, ratio in enumerate(ratios):
        if not ratio:
            continue
        source, picker = _reads(config, layer)
        assert source is not None and picker is not None, layer
        picker_source, _ = _reads(config, picker)
        assert picker_source is not None and ratios[picker_source] == ratios[source], layer


@pytest.mark.parametrize(("length", "chunk"), [(128, 16), (257, 257), (289, 16)])
def test_no_nan_logits_past_128_tokens(model: LoadedModel, length: int, chunk: int) -> None:
    prompt = prompt_ids(length, 1)
    cache = model.make_cache()
    for start in range(0, length, chunk):
        piece = mx.array([prompt[start : start + chunk]], dtype=mx.int32)
        logits = model.model.last_logits(piece, cache)
    assert not mx.isnan(logits).any().item()


@pytest.mark.parametrize("shape", [(3, 1, 4, 32), (3, 1, 32)])
@pytest.mark.parametrize(("scale", "inverse"), [(1.0, False), (4.0, False), (1.0, True)])
def test_rotate_per_row_equals_the_model_rope_row_by_row(
    model: LoadedModel, shape: tuple[int, ...], scale: float, inverse: bool
) -> None:
    from mlx_lm.models.deepseek_v41 import _apply_rope

    from mlxserve.models.deepseek_v4.v41_math import rotate

    attn = model.model.module.model.layers[1].self_attn.inner
    x = mx.random.normal(shape, key=mx.random.key(4))
    offsets = [5, 130, 17]
    how: dict[str, Any] = {"rope_dim": 16, "scale": scale, "inverse": inverse}
    batched = rotate(x, attn.rope, offset=mx.array(offsets), **how)
    rows = [_apply_rope(x[i : i + 1], attn.rope, offset=n, **how) for i, n in enumerate(offsets)]
    assert mx.array_equal(batched, mx.concatenate(rows)).item()


def test_restated_math_is_mlx_lms() -> None:
    """`dsv41_math` restates mlx-lm 0.32.2's private helpers: bit-equal on random inputs."""
    from mlx_lm.models import deepseek_v41 as theirs

    from mlxserve.models.deepseek_v4 import v41_math as ours

    key = mx.random.key(9)
    x = mx.random.normal((2, 3, 64), key=key) * 3
    assert mx.array_equal(ours.fake_quant_fp8(x, 32), theirs._fake_quant_fp8(x, 32)).item()
    for e4m3 in (False, True):
        a = ours.fake_quant_fp4(x, block_size=16, e4m3_scale=e4m3)
        b = theirs._fake_quant_fp4(x, block_size=16, e4m3_scale=e4m3)
        assert mx.array_equal(a, b).item()
    q = mx.random.normal((2, 3, 4, 32), key=mx.random.key(1))
    kvs = [mx.random.normal((2, 7, 32), key=mx.random.key(2)), mx.random.normal((2, 5, 32))]
    picks = [
        mx.random.randint(-1, 7, (2, 3, 4), key=mx.random.key(3)),
        mx.random.randint(-1, 5, (2, 3, 2), key=mx.random.key(5)),
    ]
    sinks = mx.random.normal((4,), key=mx.random.key(6))
    a = ours.sparse_attention(q, kvs, picks, sinks=sinks, scale=0.2)
    b = theirs._sparse_attention(q, kvs, picks, sinks=sinks, scale=0.2)
    assert mx.array_equal(a, b).item()
