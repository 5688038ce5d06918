"""`mlxserve bench prefix-cache`: cold vs warm TTFT on a long prefix; an 8-turn agent session."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from mlxserve.bench.report import emit
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import SamplingParams
from mlxserve.models.load import load

SUFFIX_TOKENS = 32
SESSION_TURNS = 8
SESSION_SYSTEM_TOKENS = 2048
TOOL_RESULT_TOKENS = 200
REPLY_TOKENS = 32


def synthetic_tokens(seed: int, count: int, vocab: int) -> list[int]:
    """Deterministic token ids spread over the vocabulary (no special tokens)."""
    return [(seed * 7919 + i * 104_729) % (vocab - 200) + 100 for i in range(count)]


class TimedRequest(NamedTuple):
    ttft: float
    tokens: list[int]
    cached: int  # prompt tokens served from the prefix cache


async def timed_request(engine: AsyncEngine, prompt: list[int], max_tokens: int) -> TimedRequest:
    """TTFT, generated tokens and cached prompt tokens of one request."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ttft, cached = 0.0, 0
    tokens: list[int] = []
    async for event in engine.submit(prompt, params):
        if event.token_id is not None:
            if not tokens:
                ttft = time.perf_counter() - start
            tokens.append(event.token_id)
        cached = event.cached_tokens
    return TimedRequest(ttft, tokens, cached)


async def _long_prefix(path: Path, prefix_tokens: int) -> dict[str, Any]:
    engine = AsyncEngine(EngineConfig(), lambda: load(path))
    engine.start()
    await engine.wait_ready()
    vocab = engine.model.vocab_size
    prefix = synthetic_tokens(1, prefix_tokens, vocab)
    try:
        first = prefix + synthetic_tokens(2, SUFFIX_TOKENS, vocab)
        cold, reply, _ = await timed_request(engine, first, 8)
        follow_up = first + reply + synthetic_tokens(3, 64, vocab)
        warm = (await timed_request(engine, follow_up, 8)).ttft
        # A second conversation branches off the shared prefix (the engine snapshots
        # there); a third one then reuses it.
        await timed_request(engine, prefix + synthetic_tokens(4, SUFFIX_TOKENS, vocab), 2)
        second = prefix + synthetic_tokens(5, SUFFIX_TOKENS, vocab)
        shared = (await timed_request(engine, second, 2)).ttft
    finally:
        await engine.shutdown()
    return {
        "prefix_tokens": prefix_tokens,
        "cold_ttft_s": cold,
        "warm_ttft_s": warm,
        "warm_over_cold": warm / cold,
        "shared_prefix_warm_ttft_s": shared,
        "shared_prefix_warm_over_cold": shared / cold,
    }


async def _session(path: Path) -> dict[str, Any]:
    engine = AsyncEngine(EngineConfig(), lambda: load(path))
    engine.start()
    await engine.wait_ready()
    vocab = engine.model.vocab_size
    prompt = synthetic_tokens(10, SESSION_SYSTEM_TOKENS, vocab)
    prefilled, new_tokens, ttfts = [], [], []
    try:
        for turn in range(SESSION_TURNS):
            before = engine.stats()["prefilled_tokens"]
            ttft, reply, _ = await timed_request(engine, prompt, REPLY_TOKENS)
            prefilled.append(engine.stats()["prefilled_tokens"] - before)
            ttfts.append(ttft)
            added = reply + synthetic_tokens(20 + turn, TOOL_RESULT_TOKENS, vocab)
            new_tokens.append(len(added))
            prompt = prompt + added
        stats = engine.stats()["prefix_cache"]
    finally:
        await engine.shutdown()
    return {
        "session_turns": SESSION_TURNS,
        "entries": stats["entries"],
        "hits": stats["hits"],
        "warm_turns": SESSION_TURNS - 1,
        "prefilled_tokens_per_warm_turn": statistics.mean(prefilled[1:]),
        "new_tokens_per_warm_turn": statistics.mean(new_tokens[:-1]),
        "final_prompt_tokens": len(prompt) - new_tokens[-1],
        "first_turn_ttft_s": ttfts[0],
        "warm_turn_ttft_s": statistics.median(ttfts[1:]),
    }


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
        else:
            from mlxserve.models.tiny.synthetic import make_model

            path = make_model(Path(tmp) / "deepseek_v4", "deepseek_v4", seed=0)
        figures: dict[str, Any] = {"model": str(args.model or "tiny deepseek_v4")}
        figures.update(asyncio.run(_long_prefix(path, args.prefix_tokens)))
        figures.update(asyncio.run(_session(path)))
    emit("prefix-cache", figures, args.json)
    return 0
