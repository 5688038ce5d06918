"""Memory stays bounded: many requests through one engine leave nothing behind."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from engine_helpers import collect, idle, started_engine, wait_until

from mlxserve.config import EngineConfig
from mlxserve.engine.request import SamplingParams
from mlxserve.models.load import load

BUDGET = 1 << 20


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "deepseek_v4"])
def test_memory_is_flat_over_many_requests(family: str, model_dir_factory) -> None:
    path = model_dir_factory(family)
    config = EngineConfig(max_num_seqs=4, prefix_cache_bytes=BUDGET, prefix_cache_entries=8)

    async def wave(engine, start: int) -> None:
        prompts = [[(start + i) * 31 + j for j in range(1, 41)] for i in range(4)]
        await asyncio.gather(
            *(collect(engine.submit(p, SamplingParams(max_tokens=8))) for p in prompts)
        )

    async def main() -> tuple[int, int, dict]:
        engine = await started_engine(config, lambda: load(path))
        try:
            for n in range(3):
                await wave(engine, n * 4)
            baseline = mx.get_active_memory()
            for n in range(3, 15):
                await wave(engine, n * 4)
            assert await asyncio.to_thread(wait_until, lambda: idle(engine))
            runner = engine.core.runner
            assert runner is not None
            assert not runner.caches and not runner.samplers and not runner.batch.request_ids
            return baseline, mx.get_active_memory(), engine.stats()
        finally:
            await engine.shutdown()

    baseline, final, stats = asyncio.run(main())
    assert stats["running"] == 0 and stats["finished"] == 60
    assert stats["prefix_cache"]["bytes"] <= BUDGET
    assert stats["prefix_cache"]["entries"] <= 8
    # Whatever grew is at most the prefix cache filling up to its budget.
    assert final - baseline <= BUDGET + (256 << 10), (baseline, final)
