"""Quantized KV caches inside the continuous batch (`--kv-cache-bits`).

The oracle is a plain single greedy run in the same quantized mode: a request
alone, in a batch of four beside a long prompt prefilled in chunks, after a
RAM hit and after a disk restore all give its tokens, at 8 bits (mlx-lm's
per-position layout) and at 4 bits (keys per channel, `models/channel_cache.py`,
whose own checks are in `test_kv_channel.py`). The 8-bit batched cache class
is checked against mlx-lm's one-sequence `QuantizedKVCache` directly.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_helpers import collect, started_engine, tokens_of
from mlx_lm.models.cache import BatchRotatingKVCache, QuantizedKVCache

from mlxserve.config import EngineConfig
from mlxserve.engine.decode_batch import DecodeBatch
from mlxserve.engine.request import SamplingParams
from mlxserve.kv_quant import KVQuant
from mlxserve.models.channel_cache import BatchChannelQuantizedKVCache, ChannelQuantizedKVCache
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel, ModelLoadError
from mlxserve.models.quantized_batch import BatchQuantizedKVCache
from mlxserve.models.quantized_cache import (
    apply_kv_quant,
    check_model_quantizable,
    quantize_layers,
)

MAX_TOKENS = 5
SPEC = KVQuant(bits=8, group_size=32)
# Both layouts: 8 bits per position, 4 bits with keys per channel (groups of 32 positions).
SPECS = [SPEC, KVQuant(bits=4, group_size=32)]
SPEC_IDS = ["8-bit", "4-bit"]


def _ids(seed: int, count: int, vocab: int = 120_000) -> list[int]:
    return [(seed * 7919 + i * 104_729) % vocab + 100 for i in range(count)]


# Head size 32: MLX quantizes groups of at least 32 values.
HIDDEN = 128


@pytest.fixture(scope="module")
def tiny_dirs(model_dir_factory, tmp_path_factory) -> dict[str, Path]:
    """llama and qwen3 with head size 32, and a llama whose first layer uses an
    8-token sliding window (RotatingKVCache)."""
    import json
    import shutil

    dirs = {f: model_dir_factory(f, layers=2, hidden=HIDDEN) for f in ("llama", "qwen3")}
    swa = tmp_path_factory.mktemp("llama-swa-128")
    shutil.copytree(dirs["llama"], swa, dirs_exist_ok=True)
    config = json.loads((swa / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    (swa / "config.json").write_text(json.dumps(config))
    dirs["llama_swa"] = swa
    return dirs


def _quantized(path: Path, spec: KVQuant = SPEC) -> LoadedModel:
    return apply_kv_quant(load(path), spec)


def _config(spec: KVQuant = SPEC, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = {
        "max_num_batched_tokens": 48,
        "prefix_cache_bytes": 1 << 30,
        "kv_cache_bits": spec.bits,
        "kv_cache_group_size": spec.group_size,
    }
    base.update(kw)
    return EngineConfig(**base)


# -- the batched cache class against mlx-lm's one-sequence cache ------------------------------


def _filled(model: LoadedModel, prompt: list[int]) -> list[Any]:
    cache = model.make_cache()
    mx.eval(model.model.last_logits(mx.array([prompt]), cache))
    return cache


def test_batch_rows_decode_as_their_single_caches_do(tiny_dirs) -> None:
    """Rows of different lengths merged, extended, filtered and extracted: each row's
    logits and cache match the same request decoded over its own QuantizedKVCache."""
    model = _quantized(tiny_dirs["llama"])
    prompts = [_ids(1, 37), _ids(2, 5), _ids(3, 300)]
    singles = [_filled(model, p) for p in prompts]
    assert all(type(c) is QuantizedKVCache for c in singles[0])
    batch = DecodeBatch()
    for i, prompt in enumerate(prompts):
        batch.add(f"r{i}", _filled(model, prompt))
    assert all(type(c) is BatchQuantizedKVCache for c in batch.cache)
    token = mx.array([[7], [8], [9]])
    batched = model.model.last_logits(token, batch.cache)
    for row, single in enumerate(singles):
        alone = model.model.last_logits(token[row : row + 1], single)
        assert mx.allclose(batched[row], alone[0], atol=1e-4).item()
    batch.remove({"r1"})  # the shortest row leaves: the others keep their positions
    extracted = batch.cache[0].extract(1)
    assert extracted.offset == singles[2][0].offset == 301
    for mine, theirs in zip(extracted.keys, singles[2][0].keys, strict=True):
        assert mx.array_equal(mine, theirs[..., :301, :]).item()


def test_the_batch_keeps_the_quantized_form_and_attends_to_it(tiny_dirs) -> None:
    model = _quantized(tiny_dirs["qwen3"], KVQuant(bits=8, group_size=32))
    batch = DecodeBatch()
    batch.add("a", _filled(model, _ids(4, 20)))
    layer = batch.cache[0]
    assert (layer.bits, layer.group_size) == (8, 32)
    keys, _ = layer.keys_and_values()
    assert keys[0].dtype == mx.uint32  # codes, not a full-precision copy
    batch.add("b", _filled(model, _ids(5, 3)))
    assert layer.size() == 20 and layer.left_padding.tolist() == [0, 17]


def test_four_bits_batch_keys_per_channel(tiny_dirs) -> None:
    """At 4 bits the rows hold keys quantized per channel, rows aligned at position 0."""
    model = _quantized(tiny_dirs["qwen3"], KVQuant(bits=4, group_size=32))
    single = _filled(model, _ids(4, 40))
    assert all(type(c) is ChannelQuantizedKVCache for c in single)
    batch = DecodeBatch()
    batch.add("a", single)
    batch.add("b", _filled(model, _ids(5, 3)))
    layer = batch.cache[0]
    assert type(layer) is BatchChannelQuantizedKVCache and (layer.bits, layer.group_size) == (4, 32)
    assert layer.keys[0].dtype == mx.uint32  # one complete group of 32 positions, as codes
    assert layer.lengths == [40, 3] and layer.window_start == [0, 0]


def test_caches_quantized_differently_do_not_merge(tiny_dirs) -> None:
    eight = _filled(_quantized(tiny_dirs["llama"]), _ids(6, 4))
    four = _filled(_quantized(tiny_dirs["llama"], KVQuant(4, 32)), _ids(6, 4))
    with pytest.raises(ValueError, match="quantized differently"):
        BatchQuantizedKVCache.merge([eight[0], four[0]])


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_whole_prompts_prefill_together_over_quantized_rows(tiny_dirs, spec) -> None:
    """A left-padded group prefill gives each row what it gets alone, as a quantized cache."""
    from mlxserve.engine.plan import PrefillChunk
    from mlxserve.engine.prefill_group import grouped_forward
    from mlxserve.engine.request import Request

    model = _quantized(tiny_dirs["qwen3"], spec)
    prompts = [_ids(7, 45), _ids(8, 6)]  # the longer one completes a group of 32
    requests = [Request(f"g{i}", p, SamplingParams(), 0.0) for i, p in enumerate(prompts)]
    group = [PrefillChunk(r, 0, len(r.prompt_ids)) for r in requests]
    forward = grouped_forward(model, group)
    single = type(model.make_cache()[0])
    batched = {QuantizedKVCache: BatchQuantizedKVCache}.get(single, BatchChannelQuantizedKVCache)
    assert type(forward.cache[0]) is batched
    for row, prompt in enumerate(prompts):
        alone = model.model.last_logits(mx.array([prompt]), model.make_cache())
        assert mx.allclose(forward.logits[row], alone[0], atol=1e-4).item()
        cache = forward.row_cache(row)
        assert type(cache[0]) is single and cache[0].offset == len(prompt)


# -- greedy parity through the engine ---------------------------------------------------------


def _run(path: Path, config: EngineConfig, waves: list[list[list[int]]]) -> tuple[list, dict]:
    """Each wave's prompts submitted together, waves one after another; every request's
    (tokens, cached tokens) in order, and the engine's stats at the end."""

    async def main() -> tuple[list, dict]:
        engine = await started_engine(config, lambda: load(path))
        try:
            out = []
            for wave in waves:
                params = SamplingParams(max_tokens=MAX_TOKENS)
                runs = [collect(engine.submit(p, params)) for p in wave]
                for events in await asyncio.gather(*runs):
                    out.append((tokens_of(events), events[-1].cached_tokens))
            return out, engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("family", ["llama", "qwen3", "llama_swa"])
def test_alone_batched_chunked_ram_hit_and_disk_restore_agree(
    tiny_dirs, family, spec, tmp_path
) -> None:
    family_dir = tiny_dirs[family]
    history = _ids(10, 120)
    follow_up = history + _ids(11, 7)
    others = [_ids(12, 9), _ids(13, 21), _ids(14, 4)]
    oracle_model = _quantized(family_dir, spec)

    def oracle(prompt: list[int]) -> list[int]:
        return greedy_generate(oracle_model, prompt, MAX_TOKENS)

    disk = tmp_path / "disk"
    config = _config(spec, prefix_cache_dir=str(disk), max_num_seqs=4)
    # A batch of four: the 120-token prompt is prefilled in chunks beside decoding rows.
    # Then the follow-up hits the history's entry in RAM.
    runs, stats = _run(family_dir, config, [[history, *others], [follow_up]])
    for (tokens, _), prompt in zip(runs, [history, *others, follow_up], strict=True):
        assert tokens == oracle(prompt)
    assert runs[-1][1] >= len(history)
    assert stats["prefix_cache"]["hits"] >= 1
    # A new engine: the entry comes back from disk, in its quantized form.
    # (The next turn: a window cache's entry is reused only by a longer prompt.)
    next_turn = follow_up + _ids(15, 5)
    ((tokens, cached),), stats = _run(family_dir, config, [[next_turn]])
    assert tokens == oracle(next_turn)
    # (Its entry is the follow-up's prompt and output, cut back to what the next turn
    # shares; keys quantized per channel are cut back only to a whole group.)
    slack = spec.group_size - 1 if spec.per_channel_keys else 0
    assert cached >= len(follow_up) - slack
    assert stats["prefix_cache_disk"]["hits"] == 1


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_long_chunks_are_fed_in_pieces_with_the_same_tokens(
    tiny_dirs, spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attention scores over a quantized cache are held whole, so a long chunk is fed in
    pieces that bound them; each position computes what it would in one forward."""
    from mlxserve.engine import kv_quantize
    from mlxserve.engine import runner as runner_module

    monkeypatch.setattr(kv_quantize, "SCORE_FLOOR_BYTES", 0)  # tiny models: no floor
    cut: list[list[tuple[int, int]]] = []

    def recorded(*args: Any) -> list[tuple[int, int]]:
        out = kv_quantize.leading_pieces(*args)
        cut.append(out)
        return out

    monkeypatch.setattr(runner_module, "leading_pieces", recorded)
    path = tiny_dirs["qwen3"]
    prompts = [_ids(50, 100), _ids(51, 7)]
    runs, _ = _run(path, _config(spec, prefix_cache=False), [prompts])
    oracle_model = _quantized(path, spec)
    for (tokens, _), prompt in zip(runs, prompts, strict=True):
        assert tokens == greedy_generate(oracle_model, prompt, MAX_TOKENS)
    assert any(len(p) >= 1 for p in cut)
    assert all(end - start == kv_quantize.MIN_PIECE_ROWS for p in cut for start, end in p)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_speculation_over_quantized_rows_keeps_the_plain_tokens(
    tiny_dirs, spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts of the plain run's own tokens, every third one wrong, verified over a
    quantized batch and cut back (trimmed) past the rejected ones (at 4 bits, the
    first prompt's verifies cross a group boundary at 32: a cut-back reopens it)."""
    from test_speculative import OracleDrafter

    from mlxserve.engine import core as engine_core
    from mlxserve.engine.spec.drafting import Speculator

    path = tiny_dirs["llama"]
    oracle_model = _quantized(path, spec)
    prompts = [_ids(40, 24), _ids(41, 9)]
    expected = [greedy_generate(oracle_model, p, 12) for p in prompts]
    drafter = OracleDrafter(list(zip(prompts, expected, strict=True)))
    monkeypatch.setattr(engine_core, "make_speculator", lambda *_: Speculator(drafter, 4))
    params = SamplingParams(max_tokens=12)

    async def main() -> tuple[list[list[int]], dict]:
        engine = await started_engine(_config(spec, speculative="ngram"), lambda: load(path))
        try:
            runs = await asyncio.gather(*(collect(engine.submit(p, params)) for p in prompts))
            return [tokens_of(r) for r in runs], engine.stats()
        finally:
            await engine.shutdown()

    runs, stats = asyncio.run(main())
    assert runs == expected
    assert drafter.proposed > 0 and stats["speculative"]["verify_forwards"] > 0
    assert 0 < stats["speculative"]["accepted_tokens"] < stats["speculative"]["draft_tokens"]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_after_keeps_the_head_in_full_precision_then_batches(tiny_dirs, bits) -> None:
    """With --kv-quantize-after, a prompt shorter than N prefills in full precision,
    is quantized as it joins the batch, and decodes like a single run that did the same."""
    path = tiny_dirs["llama"]
    spec = KVQuant(bits=bits, group_size=32, quantize_after=64)
    prompts = [_ids(20, 40), _ids(21, 12)]
    runs, _ = _run(path, _config(spec, kv_quantize_after=64, prefix_cache=False), [prompts])
    model = apply_kv_quant(load(path), spec)
    for (tokens, _), prompt in zip(runs, prompts, strict=True):
        cache = model.make_cache()
        logits = model.model.last_logits(mx.array([prompt]), cache)
        cache[:] = quantize_layers(cache, spec)
        expected = [int(mx.argmax(logits[0]).item())]
        while len(expected) < MAX_TOKENS:
            logits = model.model.last_logits(mx.array([[expected[-1]]]), cache)
            expected.append(int(mx.argmax(logits[0]).item()))
        assert tokens == expected


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41"])
def test_a_model_whose_caches_cannot_be_quantized_is_refused(model_dir_factory, family) -> None:
    path = model_dir_factory(family)
    with pytest.raises(ModelLoadError, match="cannot be quantized") as refused:
        check_model_quantizable(path, load_config(path), SPEC)
    assert family in str(refused.value)
    with pytest.raises(ModelLoadError, match="cannot be quantized"):
        apply_kv_quant(load(path), SPEC)


def test_a_group_size_that_does_not_divide_the_head_is_refused(model_dir_factory) -> None:
    path = model_dir_factory("llama")  # head size 16
    with pytest.raises(ModelLoadError, match="does not divide the head size 16"):
        check_model_quantizable(path, load_config(path), KVQuant(8, 32))


def test_window_layers_stay_full_precision_and_batch(tiny_dirs, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="mlxserve.models.quantized_cache"):
        model = _quantized(tiny_dirs["llama_swa"])
    # Not silently: the start says which layers stay in full precision.
    assert "1 sliding-window layer(s) stay in full precision" in caplog.text
    batch = DecodeBatch()
    batch.add("a", _filled(model, _ids(30, 12)))
    assert [type(c) for c in batch.cache] == [BatchRotatingKVCache, BatchQuantizedKVCache]


def load_config(path: Path) -> dict[str, Any]:
    from mlxserve.models.load import read_config

    return read_config(path)
