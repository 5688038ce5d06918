"""Helpers for driving AsyncEngine from synchronous tests."""

from __future__ import annotations

import asyncio
import threading
import time
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


def tokens_and_stats(
    config: EngineConfig,
    loader: Callable[[], LoadedModel],
    jobs: list[tuple[list[int], SamplingParams]],
    stagger: bool = False,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Each (prompt, params) job's tokens, run together (or one after another with
    `stagger`, so each prompt is cached for the next), and the engine's stats after."""

    async def main() -> tuple[list[list[int]], dict[str, Any]]:
        engine = await started_engine(config, loader)
        try:
            if stagger:
                outs = [await collect(engine.submit(p, params)) for p, params in jobs]
            else:
                outs = await asyncio.gather(*(collect(engine.submit(p, s)) for p, s in jobs))
            return [tokens_of(o) for o in outs], engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


class ModelWrapper:
    """Wraps a model adapter; `check(inputs)` runs before every model call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def check(self, inputs: Any) -> None:
        raise NotImplementedError

    def __call__(self, inputs: Any, cache: Any = None) -> Any:
        self.check(inputs)
        return self.inner(inputs, cache)

    def last_logits(self, inputs: Any, cache: Any = None) -> Any:
        self.check(inputs)
        return self.inner.last_logits(inputs, cache)


class SlowModel(ModelWrapper):
    """Sleeps `delay_s` before each model call once armed (prefill only, if asked)."""

    def __init__(self, inner: Any, delay_s: float, prefill_only: bool = False) -> None:
        super().__init__(inner)
        self.delay_s = delay_s
        self.prefill_only = prefill_only
        self.armed = False

    def check(self, inputs: Any) -> None:
        if self.armed and (not self.prefill_only or inputs.shape[1] > 1):
            time.sleep(self.delay_s)


class EngineKill(BaseException):
    """Not an Exception: nothing in the engine catches it, so its thread ends."""


class KillSwitch(ModelWrapper):
    """Kills the engine thread at the first model call after `armed` is set."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.armed = threading.Event()

    def check(self, inputs: Any) -> None:
        if self.armed.is_set():
            raise EngineKill("the engine thread was killed by a test")


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll `predicate` until it holds or `timeout` passes (a deadline, not a speed check)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def idle(engine: AsyncEngine) -> bool:
    return not any(engine.open_requests().values())


class Wedge(ModelWrapper):
    """Once armed, a model call blocks until `release` is set (a stalled driver)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def check(self, inputs: Any) -> None:
        if self.armed.is_set() and not self.release.is_set():
            self.entered.set()
            self.release.wait()


def wrapped_loader(path: Any, wrapper: type, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """A loader whose model is wrapped in `wrapper(model, **kw)`; the wrapper lands in
    the returned holder's "model" once the engine has loaded it."""
    holder: dict[str, Any] = {}

    def loader() -> LoadedModel:
        from mlxserve.models import load

        model = load(path)
        model.model = holder["model"] = wrapper(model.model, **kw)
        return model

    return loader, holder
