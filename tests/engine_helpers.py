"""Helpers for driving AsyncEngine from synchronous tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import SamplingParams, TokenEvent
from mlxserve.models.loaded import LoadedModel


async def collect(stream) -> list[TokenEvent]:
    return [event async for event in stream]


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


async def started_engine(config: EngineConfig, loader: Callable[[], LoadedModel]) -> AsyncEngine:
    engine = AsyncEngine(config, loader)
    engine.start()
    await engine.wait_ready(timeout=120)
    return engine


def run_requests(
    config: EngineConfig,
    loader: Callable[[], LoadedModel],
    jobs: list[tuple[list[int], SamplingParams, float]],
) -> list[list[TokenEvent]]:
    """Submit each (prompt, params, delay_s) job after its delay; return each one's events."""

    async def main() -> list[list[TokenEvent]]:
        engine = await started_engine(config, loader)

        async def one(prompt: list[int], params: SamplingParams, delay: float) -> Any:
            await asyncio.sleep(delay)
            return await collect(engine.submit(prompt, params))

        try:
            return list(await asyncio.gather(*(one(*job) for job in jobs)))
        finally:
            await engine.shutdown()

    return asyncio.run(main())
