"""The dependencies' own generate loops, the baselines of `mlxserve bench engine`.

mlx-lm's `stream_generate` and `BatchGenerator` for the families mlx-lm runs;
for DeepSeek-V4 (which mlx-lm cannot run) mlx-vlm's own `generate_step` on the
same checkpoint. Each runs on one dedicated thread over its own copy of the
model, so it never shares MLX streams with the engine's thread.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlxserve.models.load import VLM_TYPES, load, read_config

# Families whose caches mlx-lm's BatchGenerator cannot merge (no batch forms).
NO_BATCH_GENERATOR = frozenset({"deepseek_v4", "deepseek_v41"})


def decode_rate(first: float, last: float, tokens: int) -> float:
    return (tokens - 1) / max(last - first, 1e-9)


def _mlx_lm_rate(model: Any, prompt: list[int], tokens: int) -> float:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    stamps = []
    for _ in stream_generate(
        model.model.module, model.tokenizer, prompt, max_tokens=tokens, sampler=make_sampler(0.0)
    ):
        stamps.append(time.perf_counter())
    return decode_rate(stamps[0], stamps[-1], len(stamps))


def _mlx_vlm_rate(model: Any, prompt: list[int], tokens: int) -> float:
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    stamps = []
    inputs = mx.array([prompt], dtype=mx.int32)
    for _ in generate_step(inputs, model, None, None, max_tokens=tokens, temperature=0.0):
        stamps.append(time.perf_counter())
    return decode_rate(stamps[0], stamps[-1], len(stamps))


def _mlx_lm_batch_rate(model: Any, prompts: list[list[int]], tokens: int) -> float:
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


def _load_reference(path: Path) -> Any:
    if read_config(path)["model_type"] in VLM_TYPES:
        from mlx_vlm.utils import load_model

        return load_model(path)
    return load(path)


class Reference:
    """The dependency's loops on a second copy of the model, all on one dedicated thread."""

    def __init__(self, path: Path) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")
        self.model: Any = None
        self._path = path
        self.model_type = read_config(path)["model_type"]
        self.name = "mlx_vlm" if self.model_type in VLM_TYPES else "mlx_lm"

    @property
    def has_batch_generator(self) -> bool:
        return self.model_type not in NO_BATCH_GENERATOR

    async def _call(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self.model is None:
            self.model = await loop.run_in_executor(self._pool, _load_reference, self._path)
        return await loop.run_in_executor(self._pool, fn, self.model, *args)

    async def rate(self, prompt: list[int], tokens: int) -> float:
        fn = _mlx_vlm_rate if self.name == "mlx_vlm" else _mlx_lm_rate
        return float(await self._call(fn, prompt, tokens))

    async def batch_rate(self, prompts: list[list[int]], tokens: int) -> float:
        return float(await self._call(_mlx_lm_batch_rate, prompts, tokens))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def suffix_forward_s(path: Path, history: list[int], suffix: list[int], chunk: int = 512) -> float:
    """Seconds of the bare forward that feeds `suffix` onto a cache already holding
    `history` (no engine, no prefix cache): the floor of a warm turn's TTFT.
    Call it on a thread of its own (it loads its own copy of the model)."""
    import mlx.core as mx

    from mlxserve.cache.snapshot import copy_cache, share_cache

    model = load(path)
    cache = model.make_cache()
    for start in range(0, len(history), chunk):
        tokens = mx.array([history[start : start + chunk]], dtype=mx.int32)
        mx.eval(model.model.last_logits(tokens, cache))
    stored = copy_cache(cache)
    timings = []
    for _ in range(3):
        ready = share_cache(stored)
        mx.eval([a for layer in ready for a in layer.state if isinstance(a, mx.array)])
        started = time.perf_counter()
        mx.eval(model.model.last_logits(mx.array([suffix], dtype=mx.int32), ready))
        timings.append(time.perf_counter() - started)
    return sorted(timings)[1]
