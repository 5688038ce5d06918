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
from typing import Any, NamedTuple

from mlxserve.models.load import VLM_TYPES, load, read_config

# Families whose caches mlx-lm's BatchGenerator cannot merge (no batch forms).
NO_BATCH_GENERATOR = frozenset({"deepseek_v4", "deepseek_v41"})


def decode_rate(first: float, last: float, tokens: int) -> float:
    return (tokens - 1) / max(last - first, 1e-9)


class _MlxLmModel(NamedTuple):
    module: Any
    tokenizer: Any


def _mlx_lm_rate(model: _MlxLmModel, prompt: list[int], tokens: int) -> float:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    stamps = []
    for _ in stream_generate(
        model.module, model.tokenizer, prompt, max_tokens=tokens, sampler=make_sampler(0.0)
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


def _mlx_lm_batch_rate(model: _MlxLmModel, prompts: list[list[int]], tokens: int) -> float:
    """Aggregate decode tokens/s of mlx-lm's BatchGenerator on the same prompts."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model.module, max_tokens=tokens, stop_tokens=[])
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
    """The checkpoint as the dependency itself loads it, without our load-time
    changes (batched V4.1 attention, the CPU head layout)."""
    if read_config(path)["model_type"] in VLM_TYPES:
        from mlx_vlm.utils import load_model as vlm_load_model

        return vlm_load_model(path)
    from mlx_lm.utils import load as mlx_lm_load

    module, tokenizer = mlx_lm_load(str(path))[:2]
    return _MlxLmModel(module, tokenizer)


class Reference:
    """The dependency's loops on a second copy of the model, all on one dedicated thread."""

    def __init__(self, path: Path) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")
        self.model: Any = None
        self._floor: SuffixFloor | None = None
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

    async def suffix_forward_s(self, history: list[int], suffix: list[int]) -> float:
        """One bare forward of `suffix` on a ready cache of `history` (see SuffixFloor)."""
        loop = asyncio.get_running_loop()
        if self._floor is None:
            self._floor = await loop.run_in_executor(self._pool, SuffixFloor, self._path, history)
        return float(await loop.run_in_executor(self._pool, self._floor.forward_s, suffix))

    async def rate(self, prompt: list[int], tokens: int) -> float:
        fn = _mlx_vlm_rate if self.name == "mlx_vlm" else _mlx_lm_rate
        return float(await self._call(fn, prompt, tokens))

    async def batch_rate(self, prompts: list[list[int]], tokens: int) -> float:
        return float(await self._call(_mlx_lm_batch_rate, prompts, tokens))

    def close(self) -> None:
        import mlx.core as mx

        # The pool's thread ran MLX work: it drops its streams before it ends
        # (MLX's rule for a clean process exit).
        self._pool.submit(mx.clear_streams).result()
        self._pool.shutdown(wait=True)


class SuffixFloor:
    """A cache holding `history`, built once by our own forward (no engine, no
    prefix cache), to time the bare forward of a new suffix on it: the floor of
    a warm turn's TTFT. Build and use it on the reference thread."""

    def __init__(self, path: Path, history: list[int], chunk: int = 512) -> None:
        import mlx.core as mx

        from mlxserve.cache.snapshot import copy_cache

        self.model = load(path)
        cache = self.model.make_cache()
        for start in range(0, len(history), chunk):
            tokens = mx.array([history[start : start + chunk]], dtype=mx.int32)
            mx.eval(self.model.model.last_logits(tokens, cache))
        self.stored = copy_cache(cache)

    def forward_s(self, suffix: list[int]) -> float:
        """Seconds of one forward of `suffix` over a fresh handle on the stored cache."""
        import mlx.core as mx

        from mlxserve.cache.snapshot import cache_arrays, share_cache

        ready = share_cache(self.stored)
        mx.eval(cache_arrays(ready))
        started = time.perf_counter()
        mx.eval(self.model.model.last_logits(mx.array([suffix], dtype=mx.int32), ready))
        return time.perf_counter() - started
