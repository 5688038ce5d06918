"""`mlxserve bench engine`: engine overhead, batch scaling, TTFT under a long prefill.

Every ratio is measured side by side in one run, alternating the two sides.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlxserve.bench.report import emit
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import SamplingParams
from mlxserve.models.load import VLM_TYPES, load, read_config
from mlxserve.models.loaded import LoadedModel

ROUNDS = 3
PROMPT_TOKENS = 32


def _decode_rate(first: float, last: float, tokens: int) -> float:
    return (tokens - 1) / max(last - first, 1e-9)


async def _engine_stream(engine: AsyncEngine, prompt: list[int], tokens: int) -> tuple[float, ...]:
    """(submit time, first token time, last token time) of one request."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    submitted = time.perf_counter()
    first = last = 0.0
    async for event in engine.submit(prompt, params):
        now = time.perf_counter()
        if event.token_id is not None and first == 0.0:
            first = now
        last = now
    return submitted, first, last


def _mlx_lm_rate(model: LoadedModel, prompt: list[int], tokens: int) -> float:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    stamps = []
    for _ in stream_generate(
        model.model.module, model.tokenizer, prompt, max_tokens=tokens, sampler=make_sampler(0.0)
    ):
        stamps.append(time.perf_counter())
    return _decode_rate(stamps[0], stamps[-1], len(stamps))


def _mlx_lm_batch_rate(model: LoadedModel, prompts: list[list[int]], tokens: int) -> float:
    """Aggregate decode tokens/s of mlx-lm's BatchGenerator on the same prompts."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model.model.module, max_tokens=tokens, stop_tokens=[])
    generator.insert(prompts, [tokens] * len(prompts))
    produced = 0
    start = 0.0
    while produced < tokens * len(prompts):
        responses = generator.next_generated()
        if not responses:
            break
        if start == 0.0:
            start = time.perf_counter()
            produced -= len(responses)
        produced += len(responses)
    elapsed = time.perf_counter() - start
    generator.close()
    return produced / max(elapsed, 1e-9)


async def _batch_rate(engine: AsyncEngine, prompts: list[list[int]], tokens: int) -> float:
    results = await asyncio.gather(*(_engine_stream(engine, p, tokens) for p in prompts))
    first = max(r[1] for r in results)
    last = max(r[2] for r in results)
    # Count only tokens produced while every stream was decoding.
    produced = sum(tokens - 1 for _ in results) - sum(
        _tokens_before(first, r, tokens) for r in results
    )
    return produced / max(last - first, 1e-9)


def _tokens_before(moment: float, result: tuple[float, ...], tokens: int) -> int:
    _, first, last = result
    if moment <= first:
        return 0
    return int((tokens - 1) * min(1.0, (moment - first) / max(last - first, 1e-9)))


async def _ttft(engine: AsyncEngine, prompt: list[int]) -> float:
    submitted, first, _ = await _engine_stream(engine, prompt, 2)
    return first - submitted


async def _ttft_under_long_prefill(engine: AsyncEngine, long: list[int], short: list[int]) -> float:
    long_task = asyncio.create_task(_engine_stream(engine, long, 2))
    await asyncio.sleep(0.05)
    ttft = await _ttft(engine, short)
    await long_task
    return ttft


class _Reference:
    """mlx-lm's own loops on a second copy of the model, all on one dedicated thread."""

    def __init__(self, path: Path) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-lm-reference")
        self.model: LoadedModel | None = None
        self._path = path

    async def call(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self.model is None:
            self.model = await loop.run_in_executor(self._pool, load, self._path)
        return await loop.run_in_executor(self._pool, fn, self.model, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


async def _measure(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    engine = AsyncEngine(EngineConfig(prefix_cache=False), lambda: load(path))
    engine.start()
    await engine.wait_ready()
    model = engine.model
    if model.model_type in VLM_TYPES:
        raise SystemExit(
            f"bench engine compares against mlx-lm, which cannot run {model.model_type}"
        )
    reference = _Reference(path)
    vocab = model.vocab_size
    prompt = [(i * 7919 + 13) % vocab for i in range(PROMPT_TOKENS)]
    prompts = [[(i * 104729 + j * 31 + 5) % vocab for i in range(PROMPT_TOKENS)] for j in range(8)]
    long = [(i * 7 + 3) % vocab for i in range(args.long_prompt)]
    tokens = args.tokens
    ours, theirs, single, batched, alone, contended = [], [], [], [], [], []
    try:
        await _engine_stream(engine, prompt, 4)  # warm-up
        for _ in range(ROUNDS):
            _, first, last = await _engine_stream(engine, prompt, tokens)
            ours.append(_decode_rate(first, last, tokens))
            theirs.append(await reference.call(_mlx_lm_rate, prompt, tokens))
            single.append(ours[-1])
            batched.append(await _batch_rate(engine, prompts, tokens))
        mlx_lm_single = statistics.median(theirs)
        mlx_lm_batched = await reference.call(_mlx_lm_batch_rate, prompts, tokens)
        for _ in range(2):
            alone.append(await _ttft(engine, prompt))
            contended.append(await _ttft_under_long_prefill(engine, long, prompt))
    finally:
        await engine.shutdown()
        reference.close()
    unchunked = await _unchunked_ttft_ratio(path, long, prompt)
    return {
        "model_type": model.model_type,
        "hidden_size": model.config.get("hidden_size"),
        "decode_tokens": tokens,
        "engine_tokens_per_s": statistics.median(ours),
        "mlx_lm_tokens_per_s": mlx_lm_single,
        "engine_efficiency": statistics.median(ours) / mlx_lm_single,
        "batch_8_tokens_per_s": statistics.median(batched),
        "batch_scaling_8": statistics.median(batched) / statistics.median(single),
        "mlx_lm_batch_8_tokens_per_s": mlx_lm_batched,
        "mlx_lm_batch_scaling_8": mlx_lm_batched / mlx_lm_single,
        "long_prompt_tokens": len(long),
        "short_ttft_alone_s": statistics.median(alone),
        "short_ttft_under_long_prefill_s": statistics.median(contended),
        "short_ttft_under_long_prefill": statistics.median(contended) / statistics.median(alone),
        "short_ttft_under_long_prefill_unchunked": unchunked,
        "batch_8_vs_mlx_lm_batch_generator": statistics.median(batched) / mlx_lm_batched,
    }


async def _unchunked_ttft_ratio(path: Path, long: list[int], short: list[int]) -> float:
    """The same TTFT ratio with chunking off, for comparison."""
    config = EngineConfig(prefix_cache=False, max_prefill_tokens=len(long) + len(short))
    engine = AsyncEngine(config, lambda: load(path))
    engine.start()
    await engine.wait_ready()
    try:
        await _ttft(engine, short)
        alone = await _ttft(engine, short)
        contended = await _ttft_under_long_prefill(engine, long, short)
    finally:
        await engine.shutdown()
    return contended / alone


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
            model_type = read_config(path)["model_type"]
            if model_type in VLM_TYPES:
                print(f"bench engine compares with mlx-lm, which cannot run {model_type}")
                return 2
        else:
            from mlxserve.models.synthetic import make_model

            path = make_model(Path(tmp) / "llama-h64", "llama", seed=0, hidden=64)
        figures = asyncio.run(_measure(path, args))
    emit("engine", figures, args.json)
    return 0
