"""Prefix cache wired into the engine: warm output == cold output, one entry per conversation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_helpers import collect, started_engine, tokens_of

from mlxserve.config import EngineConfig
from mlxserve.engine.request import SamplingParams
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel

CACHE_ON = EngineConfig(max_prefill_tokens=24, prefix_cache_bytes=1 << 30)


def _ids(seed: int, count: int, vocab: int = 120_000) -> list[int]:
    return [(seed * 7919 + i * 104_729) % vocab + 100 for i in range(count)]


def _turn_pairs(first: list[int], reply: list[int]) -> dict[str, list[int]]:
    """Second-turn prompts of five conversation shapes, given turn one and its reply."""
    return {
        "append": first + reply + _ids(3, 11),
        "edit_tail": first[:-5] + _ids(4, 9),
        "retry": list(first),
        "shared_system": first[:40] + _ids(5, 13),
        "shorter": first[:20],
    }


def _run(path: Path, config: EngineConfig, prompts: list[list[int]], max_tokens: int):
    """Run prompts one after another through one engine; tokens and final stats."""

    async def main():
        engine = await started_engine(config, lambda: load(path))
        try:
            outputs = []
            for prompt in prompts:
                events = await collect(engine.submit(prompt, SamplingParams(max_tokens=max_tokens)))
                outputs.append((tokens_of(events), events[-1].cached_tokens))
            return outputs, engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


@pytest.fixture(params=["llama", "llama_swa", "deepseek_v4"])
def cache_model(request, model_dir_factory, swa_model_dir) -> tuple[Path, LoadedModel]:
    """(checkpoint dir for the engine, a main-thread copy for the oracle)."""
    path = swa_model_dir if request.param == "llama_swa" else model_dir_factory(request.param)
    return path, load(path)


def test_warm_output_equals_cold_output(cache_model: tuple[Path, LoadedModel]) -> None:
    path, oracle = cache_model
    first = _ids(1, 60)
    reply = greedy_generate(oracle, first, 6)
    prompts = [first, *_turn_pairs(first, reply).values()]
    expected = [greedy_generate(oracle, p, 6) for p in prompts]
    # Each shape starts from a cache that holds only turn one.
    for shape_prompt, shape_expected in zip(prompts[1:], expected[1:], strict=True):
        outputs, _ = _run(path, CACHE_ON, [first, shape_prompt], 6)
        assert [tokens for tokens, _ in outputs] == [expected[0], shape_expected]
    outputs, _ = _run(path, CACHE_ON, prompts, 6)
    cached = dict(zip(["first", *_turn_pairs(first, reply)], (c for _, c in outputs), strict=True))
    assert cached["first"] == 0
    assert cached["append"] >= len(first)
    assert cached["retry"] < len(first)
    assert [tokens for tokens, _ in outputs] == expected


def test_agentic_session_keeps_one_entry_and_prefills_only_new_tokens(model_dir_factory) -> None:
    path = model_dir_factory("deepseek_v4")
    prompt = _ids(7, 50)

    async def main() -> tuple[list[int], dict]:
        engine = await started_engine(CACHE_ON, lambda: load(path))
        nonlocal prompt
        prefilled = []
        try:
            for turn in range(8):
                before = engine.stats()["prefilled_tokens"]
                events = await collect(engine.submit(prompt, SamplingParams(max_tokens=5)))
                prefilled.append(engine.stats()["prefilled_tokens"] - before)
                new_tokens = tokens_of(events) + _ids(20 + turn, 12)
                if turn < 7:
                    assert prefilled[-1] <= len(prompt)
                    prompt = prompt + new_tokens
            return prefilled, engine.stats()
        finally:
            await engine.shutdown()

    prefilled, stats = asyncio.run(main())
    assert stats["prefix_cache"]["entries"] == 1
    assert stats["prefix_cache"]["hits"] == 7
    assert prefilled[0] == 50
    # Each warm turn feeds only the reply and the tool result (5 + 12 tokens).
    assert all(count <= 17 + 1 for count in prefilled[1:]), prefilled


def test_concurrent_conversations_share_the_system_prompt(
    loaded_factory, model_dir_factory
) -> None:
    oracle = loaded_factory("deepseek_v4")
    system = _ids(9, 48)
    seed, first_a, first_b, later = (system + _ids(n, 10) for n in (30, 31, 32, 33))

    async def main() -> None:
        engine = await started_engine(CACHE_ON, lambda: load(model_dir_factory("deepseek_v4")))
        try:
            await collect(engine.submit(seed, SamplingParams(max_tokens=3)))
            a, b = await asyncio.gather(
                collect(engine.submit(first_a, SamplingParams(max_tokens=3))),
                collect(engine.submit(first_b, SamplingParams(max_tokens=3))),
            )
            second_a = first_a + tokens_of(a) + _ids(40, 8)
            second_b = first_b + tokens_of(b) + _ids(41, 8)
            a2, b2, c = await asyncio.gather(
                collect(engine.submit(second_a, SamplingParams(max_tokens=3))),
                collect(engine.submit(second_b, SamplingParams(max_tokens=3))),
                collect(engine.submit(later, SamplingParams(max_tokens=3))),
            )
            assert a2[-1].cached_tokens == len(first_a)
            assert b2[-1].cached_tokens == len(first_b)
            # A new conversation reuses the system prompt the others branched from.
            assert c[-1].cached_tokens >= len(system)
            assert tokens_of(c) == greedy_generate(oracle, later, 3)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_trimmable_cache_keeps_prompt_plus_output_and_trims_back(model_dir_factory) -> None:
    """Plain KV: the finished turn leaves one `prompt + output` entry; a reply that was
    re-rendered differently still reuses the shared part, trimmed back."""
    path = model_dir_factory("llama")
    oracle = load(path)
    first = _ids(1, 40)
    reply = greedy_generate(oracle, first, 6)
    continued = first + reply + _ids(3, 9)
    rerendered = first + reply[:2] + _ids(6, 9)

    async def main() -> None:
        engine = await started_engine(CACHE_ON, lambda: load(path))
        try:
            await collect(engine.submit(first, SamplingParams(max_tokens=6)))
            assert engine.stats()["prefix_cache"]["entries"] == 1
            for prompt, reused in ((continued, len(first) + 5), (rerendered, len(first) + 2)):
                events = await collect(engine.submit(prompt, SamplingParams(max_tokens=4)))
                assert events[-1].cached_tokens == reused
                assert tokens_of(events) == greedy_generate(oracle, prompt, 4)
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v4"])
def test_a_hit_suffix_fed_in_two_forwards_gives_the_cold_output(model_dir_factory, family) -> None:
    # A step target far below one token's cost paces every other prefill to its
    # shortest chunks; a warm turn's 48-token suffix, alone, goes in two forwards.
    path = model_dir_factory(family)
    oracle = load(path)
    first = _ids(8, 60)
    second = first + _ids(9, 48)
    expected = [greedy_generate(oracle, p, 6) for p in (first, second)]
    config = EngineConfig(max_prefill_tokens=64, max_step_ms=0.001, prefix_cache_bytes=1 << 30)
    outputs, stats = _run(path, config, [first, second], 6)
    assert [tokens for tokens, _ in outputs] == expected
    assert outputs[1][1] >= len(first)  # the second turn hit the first one's entry
