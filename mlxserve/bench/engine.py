"""`mlxserve bench engine`: engine overhead, batch scaling, latency under a long prefill,
and the cost of a prefix-cache hit on a long history.

Every ratio is measured side by side in one run, alternating the two sides.
The baseline is the dependency's own loop on the same checkpoint (mlx-lm, or
mlx-vlm for DeepSeek-V4; see `engine_refs.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mlxserve.bench.engine_refs import Reference, decode_rate
from mlxserve.bench.report import emit
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import SamplingParams
from mlxserve.models.load import load

PROMPT_TOKENS = 32
SUFFIX_TOKENS = 64
_ids = itertools.count()


async def _stamps(engine: AsyncEngine, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    """(submit time, the time each token arrived) of one request."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    submitted = time.perf_counter()
    stamps = []
    async for event in engine.submit(prompt, params):
        if event.token_id is not None:
            stamps.append(time.perf_counter())
    return submitted, stamps


async def _rate(engine: AsyncEngine, prompt: list[int], tokens: int) -> float:
    _, stamps = await _stamps(engine, prompt, tokens)
    return decode_rate(stamps[0], stamps[-1], len(stamps))


async def _batch_rate(engine: AsyncEngine, prompts: list[list[int]], tokens: int) -> float:
    """Aggregate tokens/s from the moment every stream was decoding to the last token."""
    results = await asyncio.gather(*(_stamps(engine, p, tokens) for p in prompts))
    first = max(stamps[0] for _, stamps in results)
    last = max(stamps[-1] for _, stamps in results)
    produced = sum(sum(1 for t in stamps if t > first) for _, stamps in results)
    return produced / max(last - first, 1e-9)


async def _ttft(engine: AsyncEngine, prompt: list[int]) -> float:
    submitted, stamps = await _stamps(engine, prompt, 2)
    return stamps[0] - submitted


async def _ttft_under_long_prefill(engine: AsyncEngine, long: list[int], short: list[int]) -> float:
    long_task = asyncio.create_task(_stamps(engine, long, 2))
    await asyncio.sleep(0.05)
    ttft = await _ttft(engine, short)
    await long_task
    return ttft


async def _solo_itl(engine: AsyncEngine, prompt: list[int], tokens: int) -> float:
    _, stamps = await _stamps(engine, prompt, tokens)
    return statistics.median(b - a for a, b in itertools.pairwise(stamps))


async def _itl_under_long_prefill(engine: AsyncEngine, long: list[int], short: list[int]) -> float:
    """Median gap between a decoding stream's tokens while a long prompt prefills."""
    request_id = f"bench-decoder-{next(_ids)}"
    params = SamplingParams(max_tokens=1_000_000, ignore_eos=True)
    stamps: list[float] = []
    window: list[float] = []

    async def decoder() -> None:
        async for event in engine.submit(short, params, request_id):
            if event.token_id is not None:
                stamps.append(time.perf_counter())

    task = asyncio.create_task(decoder())
    while len(stamps) < 4:
        await asyncio.sleep(0.005)
    submitted, long_stamps = await _stamps(engine, long, 1)
    window = [t for t in stamps if submitted <= t <= long_stamps[0]]
    engine.abort(request_id)
    await task
    gaps = [b - a for a, b in itertools.pairwise(window)]
    return statistics.median(gaps) if gaps else long_stamps[0] - submitted


async def _started(config: EngineConfig, path: Path) -> AsyncEngine:
    engine = AsyncEngine(config, lambda: load(path))
    engine.start()
    await engine.wait_ready()
    return engine


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    return [[(i * 104729 + j * 31 + seed) % vocab for i in range(length)] for j in range(count)]


async def _throughput(
    engine: AsyncEngine, reference: Reference, vocab: int, tokens: int, rounds: int
) -> dict[str, Any]:
    prompt = _prompts(vocab, 1, PROMPT_TOKENS, 13)[0]
    prompts = _prompts(vocab, 8, PROMPT_TOKENS, 5)
    ours, theirs, batched_8, batched_4, theirs_8 = [], [], [], [], []
    await _rate(engine, prompt, 4)  # warm-up
    for _ in range(rounds):
        ours.append(await _rate(engine, prompt, tokens))
        theirs.append(await reference.rate(prompt, tokens))
        batched_8.append(await _batch_rate(engine, prompts, tokens))
        if reference.has_batch_generator:
            theirs_8.append(await reference.batch_rate(prompts, tokens))
        batched_4.append(await _batch_rate(engine, prompts[:4], tokens))
    single, baseline = statistics.median(ours), statistics.median(theirs)
    figures: dict[str, Any] = {
        "baseline": reference.name,
        "engine_tokens_per_s": single,
        "mlx_lm_tokens_per_s": baseline,
        "engine_efficiency": single / baseline,
        "batch_4_tokens_per_s": statistics.median(batched_4),
        "batch_scaling_4": statistics.median(batched_4) / single,
        "batch_8_tokens_per_s": statistics.median(batched_8),
        "batch_scaling_8": statistics.median(batched_8) / single,
    }
    if theirs_8:
        generator = statistics.median(theirs_8)
        figures["mlx_lm_batch_8_tokens_per_s"] = generator
        figures["mlx_lm_batch_scaling_8"] = generator / baseline
        figures["batch_8_vs_mlx_lm_batch_generator"] = figures["batch_8_tokens_per_s"] / generator
    return figures


async def _latency(engine: AsyncEngine, vocab: int, long: list[int], rounds: int) -> dict[str, Any]:
    """TTFT of a short prompt and ITL of a stream while a long prompt prefills, vs alone."""
    short = _prompts(vocab, 1, PROMPT_TOKENS, 17)[0]
    alone, contended, itl_alone, itl_contended = [], [], [], []
    for _ in range(rounds):
        alone.append(await _ttft(engine, short))
        contended.append(await _ttft_under_long_prefill(engine, long, short))
        itl_alone.append(await _solo_itl(engine, short, 32))
        itl_contended.append(await _itl_under_long_prefill(engine, long, short))
    return {
        "long_prompt_tokens": len(long),
        "short_ttft_alone_s": statistics.median(alone),
        "short_ttft_under_long_prefill_s": statistics.median(contended),
        "short_ttft_under_long_prefill": statistics.median(contended) / statistics.median(alone),
        "itl_alone_s": statistics.median(itl_alone),
        "itl_under_long_prefill_s": statistics.median(itl_contended),
        "itl_under_long_prefill": statistics.median(itl_contended) / statistics.median(itl_alone),
    }


async def _unchunked_ttft_ratio(path: Path, long: list[int], short: list[int]) -> float:
    """The same TTFT ratio with chunking off (one budget for the whole prompt, no pacing)."""
    budget = len(long) + len(short)
    config = EngineConfig(prefix_cache=False, max_num_batched_tokens=budget, max_step_ms=1e9)
    engine = await _started(config, path)
    try:
        await _ttft(engine, short)
        alone = await _ttft(engine, short)
        contended = await _ttft_under_long_prefill(engine, long, short)
    finally:
        await engine.shutdown()
    return contended / alone


async def _warm_ttft_ratio(
    path: Path, vocab: int, history_tokens: int, rounds: int
) -> dict[str, Any]:
    """TTFT of a 64-token new suffix on a cached long history / TTFT of a cold 64-token
    prompt, and both against the bare forward of such a suffix on a ready cache."""
    config = EngineConfig(prefix_cache_bytes=1 << 32)
    engine = await _started(config, path)
    reference = Reference(path)
    history = prompt = [(i * 7 + 11) % vocab for i in range(history_tokens)]
    warm, cold, floor = [], [], []
    try:
        await _ttft(engine, _prompts(vocab, 1, SUFFIX_TOKENS, 3)[0])  # warm-up
        _, stamps = await _stamps(engine, prompt, 1)
        for turn in range(rounds):
            cold.append(await _ttft(engine, _prompts(vocab, 1, SUFFIX_TOKENS, 101 + turn)[0]))
            suffix = _prompts(vocab, 1, SUFFIX_TOKENS, 201 + turn)[0]
            prompt = prompt + suffix
            warm.append(await _ttft(engine, prompt))
            floor.append(await reference.suffix_forward_s(history, suffix))
        hits = engine.stats()["prefix_cache"]["hits"]
    finally:
        await engine.shutdown()
        reference.close()
    warm_s, cold_s, floor_s = (statistics.median(x) for x in (warm, cold, floor))
    return {
        "history_tokens": history_tokens,
        "warm_ttft_8k_s": warm_s,
        "cold_ttft_64_s": cold_s,
        "warm_ttft_8k_over_cold_64": warm_s / cold_s,
        # The bare forward of the suffix on a ready cache: what attention over the
        # history costs by itself, with nothing copied or looked up. Over the cold
        # TTFT it is the least warm_ttft_8k_over_cold_64 this machine allows.
        "suffix_forward_on_8k_s": floor_s,
        "warm_ttft_8k_over_suffix_forward": warm_s / floor_s,
        "suffix_forward_over_cold_64": floor_s / cold_s,
        "warm_hits": hits,
    }


async def _measure(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    engine = await _started(EngineConfig(prefix_cache=False), path)
    model = engine.model
    vocab = model.vocab_size
    reference = Reference(path)
    long = [(i * 7 + 3) % vocab for i in range(args.long_prompt)]
    figures: dict[str, Any] = {
        "model_type": model.model_type,
        "hidden_size": model.config.get("hidden_size"),
        "decode_tokens": args.tokens,
        "rounds": args.rounds,
    }
    try:
        figures.update(await _throughput(engine, reference, vocab, args.tokens, args.rounds))
        figures.update(await _latency(engine, vocab, long, args.rounds))
    finally:
        await engine.shutdown()
        reference.close()
    short = _prompts(vocab, 1, PROMPT_TOKENS, 17)[0]
    figures["short_ttft_under_long_prefill_unchunked"] = await _unchunked_ttft_ratio(
        path, long, short
    )
    figures.update(await _warm_ttft_ratio(path, vocab, args.history_tokens, args.rounds))
    return figures


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
        else:
            from mlxserve.models.tiny.synthetic import make_model

            path = make_model(Path(tmp) / "llama-h64", "llama", seed=0, hidden=64)
        figures = asyncio.run(_measure(path, args))
    emit("engine", figures, args.json)
    return 0
