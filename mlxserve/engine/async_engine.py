"""AsyncEngine: the asyncio face of EngineCore.

Events cross from the engine thread with `loop.call_soon_threadsafe`, one call
per step; the event loop never waits on MLX.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from mlxserve.config import EngineConfig
from mlxserve.engine.core import EngineCore
from mlxserve.engine.request import (
    EngineNotReady,
    EngineOverloaded,
    Request,
    RequestStatus,
    SamplingParams,
    TokenEvent,
)
from mlxserve.models.loaded import LoadedModel

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig, loader: Callable[[], LoadedModel]) -> None:
        self.config = config
        self._core = EngineCore(config, loader, self._emit_from_engine)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        """Start the owner thread (it loads the model). Call from a running event loop."""
        self._loop = asyncio.get_running_loop()
        self._core.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(asyncio.to_thread(self._core.ready.wait), timeout)
        if self._core.load_error is not None:
            raise EngineNotReady(self._core.load_error)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._core.stop)

    @property
    def ready(self) -> bool:
        return self._core.ready.is_set() and self._core.load_error is None

    @property
    def load_error(self) -> str | None:
        return self._core.load_error

    @property
    def model(self) -> LoadedModel:
        if not self.ready or self._core.model is None:
            raise EngineNotReady(self._core.load_error or "the model is still loading")
        return self._core.model

    @property
    def core(self) -> EngineCore:
        return self._core

    # -- requests -----------------------------------------------------------
    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Queue a request; its events arrive through the returned iterator.

        Raises EngineOverloaded when the waiting queue is full and ValueError for
        a prompt the engine cannot take. Leaving the iterator early aborts.
        """
        model = self.model
        self._validate(prompt_ids, params, model)
        if self._num_waiting() >= self.config.max_waiting:
            raise EngineOverloaded(
                f"{self.config.max_waiting} requests are already waiting; retry shortly"
            )
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[request_id] = events
        request = Request(request_id, list(prompt_ids), params, time.monotonic())
        self._core.add(request)
        return self._stream(request_id, events)

    def _validate(self, prompt_ids: list[int], params: SamplingParams, model: LoadedModel) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= token < model.vocab_size for token in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {model.vocab_size})")
        limit = self.config.max_model_len
        if limit is not None and len(prompt_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the maximum context is {limit}"
            )

    async def _stream(
        self, request_id: str, events: asyncio.Queue[TokenEvent]
    ) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while True:
                event = await events.get()
                if event.finished:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._core.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe and non-blocking; the engine drops the request at its next step."""
        self._core.abort(request_id)

    def request_status(self, request_id: str) -> RequestStatus | None:
        scheduler = self._core.scheduler
        if scheduler is None:
            return None
        return scheduler.recent_status.get(request_id)

    # -- engine thread -> event loop ------------------------------------------
    def _emit_from_engine(self, events: list[TokenEvent]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:
            logger.debug("event loop closed; dropping %d events", len(events))

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            target = self._queues.get(event.request_id)
            if target is not None:
                target.put_nowait(event)

    # -- introspection ------------------------------------------------------
    def _num_waiting(self) -> int:
        scheduler = self._core.scheduler
        waiting = scheduler.num_waiting if scheduler is not None else 0
        return waiting + self._core.inbox_size

    def stats(self) -> dict[str, Any]:
        scheduler = self._core.scheduler
        stats: dict[str, Any] = {
            "ready": self.ready,
            "running": scheduler.num_running if scheduler else 0,
            "waiting": self._num_waiting(),
            "steps": self._core.steps,
            "kv_cache_bytes": self._core.kv_bytes,
        }
        if scheduler is not None:
            stats.update(asdict(scheduler.counters))
        prefix_cache = self._core.prefix_cache
        stats["prefix_cache"] = asdict(prefix_cache.stats()) if prefix_cache else None
        return stats
