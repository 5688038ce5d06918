"""AsyncEngine: the asyncio face of EngineCore.

Events cross from the engine thread with `loop.call_soon_threadsafe`, one call
per phase of a step; the event loop never waits on MLX.

A request's queue leaves `_queues` when its finish event is dispatched (or its
stream ends), so a client gone before its stream started leaves nothing
behind. If the engine thread dies, every open stream gets an error at once and
later submits are refused (`failure` says why).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mlxserve.config import EngineConfig
from mlxserve.engine.budget import KVPool
from mlxserve.engine.core import EngineCore
from mlxserve.engine.faults import FaultHook
from mlxserve.engine.request import (
    EngineNotReady,
    EngineOverloaded,
    Request,
    RequestStatus,
    SamplingParams,
    TokenEvent,
)
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.vision import PromptImage, text_ids

if TYPE_CHECKING:
    from mlxserve.engine.distributed.publisher import PlanPublisher

logger = logging.getLogger(__name__)

# A stream waits this long past --request-timeout for the engine's own timeout
# error before it gives up on the engine (a step that never returns).
STREAM_GRACE_S = 2.0


@dataclass(frozen=True)
class RequestProgress:
    """One request's state in the engine: prefill done of the tokens to feed, and output."""

    status: RequestStatus
    computed: int
    fill: int
    cached: int
    generated: int


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        loader: Callable[[], LoadedModel],
        fault: FaultHook | None = None,
        pool: KVPool | None = None,
        member: str = "",
        publisher: PlanPublisher | None = None,
    ) -> None:
        self.config = config
        self._core = EngineCore(
            config,
            loader,
            self._emit_from_engine,
            fault=fault,
            on_death=self._engine_died,
            pool=pool,
            member=member,
            publisher=publisher,
        )
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
        core = self._core
        return core.ready.is_set() and core.load_error is None and core.failure is None

    @property
    def failure(self) -> str | None:
        """Why the engine thread ended, if it ended for any reason but a shutdown."""
        return self._core.failure

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
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: tuple[PromptImage, ...] = (),
    ) -> AsyncIterator[TokenEvent]:
        """Queue a request; its events arrive through the returned iterator.

        Raises EngineOverloaded when the waiting queue is full and ValueError for
        a prompt the engine cannot take. Leaving the iterator early aborts.
        """
        if self._core.failure is not None:
            raise EngineNotReady(f"the engine failed: {self._core.failure}")
        model = self.model
        self._validate(prompt_ids, params, model, images)
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
        request.images = tuple(images)
        if images and model.vision is not None and model.vision.whole_images:
            request.whole_spans = tuple((image.start, image.end) for image in images)
        self._core.add(request)
        return self._stream(request_id, events, request.arrival_time)

    def _validate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        model: LoadedModel,
        images: tuple[PromptImage, ...] = (),
    ) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= token < model.vocab_size for token in text_ids(prompt_ids, images, model)):
            raise ValueError(f"prompt token ids must be in [0, {model.vocab_size})")
        limit = self.config.max_model_len
        if limit is not None and len(prompt_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the maximum context is {limit}"
            )

    async def _stream(
        self, request_id: str, events: asyncio.Queue[TokenEvent], arrival: float
    ) -> AsyncIterator[TokenEvent]:
        finished = False
        timeout = self.config.request_timeout_s
        deadline = None if timeout is None else arrival + timeout + STREAM_GRACE_S
        try:
            while True:
                if deadline is None:
                    event = await events.get()
                else:
                    try:
                        event = await asyncio.wait_for(events.get(), deadline - time.monotonic())
                    except TimeoutError:
                        yield self._timed_out(request_id, timeout)
                        return
                if event.finished:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._core.abort(request_id)

    @staticmethod
    def _timed_out(request_id: str, timeout: float | None) -> TokenEvent:
        logger.warning("request %s got no finish from the engine in time", request_id)
        return TokenEvent(
            request_id,
            None,
            finish_reason="error",
            error=f"the request timed out after {timeout:g} s (the engine did not answer)",
        )

    def abort(self, request_id: str) -> None:
        """Thread-safe and non-blocking; the engine drops the request at its next step."""
        self._core.abort(request_id)

    def finish(self, request_id: str) -> None:
        """End a request as a normal `stop` (a stop string matched); thread-safe."""
        self._core.finish(request_id)

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
            if event.finished:
                target = self._queues.pop(event.request_id, None)
            else:
                target = self._queues.get(event.request_id)
            if target is not None:
                target.put_nowait(event)

    def _engine_died(self, reason: str) -> None:
        """On the engine thread, as it ends: fail every open stream on the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._fail_all, reason)
        except RuntimeError:
            logger.debug("event loop closed; the engine died: %s", reason)

    def _fail_all(self, reason: str) -> None:
        queues, self._queues = self._queues, {}
        for request_id, target in queues.items():
            target.put_nowait(
                TokenEvent(
                    request_id, None, finish_reason="error", error=f"the engine failed: {reason}"
                )
            )

    # -- introspection ------------------------------------------------------
    def _num_waiting(self) -> int:
        """Requests queued for a slot (queued abort commands are not requests)."""
        scheduler = self._core.scheduler
        waiting = scheduler.num_waiting if scheduler is not None else 0
        return waiting + self._core.pending_adds

    def open_requests(self) -> dict[str, int]:
        """How much per-request state the engine holds now (all zero when idle)."""
        core = self._core
        scheduler, runner = core.scheduler, core.runner
        return {
            "streams": len(self._queues),
            "pending": core.pending_adds,
            "known": len(scheduler.by_id) if scheduler else 0,
            "waiting": len(scheduler.waiting) if scheduler else 0,
            "running": len(scheduler.running) if scheduler else 0,
            "caches": len(runner.caches) if runner else 0,
            "samplers": len(runner.samplers) if runner else 0,
            "batch_rows": len(runner.batch.request_ids) if runner else 0,
        }

    def progress(self, request_id: str) -> RequestProgress | None:
        """Where a request stands, as the engine thread last left it (None once it has
        left the engine, or before the engine took it in). A dict lookup and a few
        integers, read without waiting on the engine thread (for the status page)."""
        scheduler = self._core.scheduler
        request = scheduler.by_id.get(request_id) if scheduler is not None else None
        if request is None:
            return None
        return RequestProgress(
            request.status,
            request.num_computed,
            request.num_fill,
            request.cached_tokens,
            len(request.output_ids),
        )

    def stats(self) -> dict[str, Any]:
        core = self._core
        scheduler = core.scheduler
        memory = core.memory
        stats: dict[str, Any] = {
            "ready": self.ready,
            "alive": core.failure is None and core.load_error is None,
            "failure": core.failure,
            "stalled": core.stalled,
            "running": scheduler.num_running if scheduler else 0,
            "waiting": self._num_waiting(),
            "steps": core.steps,
            "step_s": core.step_s,
            "last_step_s": core.last_step_s,
            "weight_bytes": core.weight_bytes,
            "kv_budget_bytes": memory.budget_bytes if memory else None,
            "kv_pool": memory.pool.stats() if memory and memory.pool else None,
            "cache_bytes": core.cache_bytes,
            "peak_cache_bytes": core.peak_cache_bytes,
            "kv_cache_bytes": core.kv_bytes,
            "mlx_active_bytes": core.mlx_active_bytes,
            "mlx_cache_bytes": core.mlx_cache_bytes,
            "mlx_peak_bytes": core.mlx_peak_bytes,
        }
        if scheduler is not None:
            stats.update(asdict(scheduler.counters))
            speculator = scheduler.speculator
            stats["speculative"] = speculator.stats() if speculator is not None else None
        prefix_cache = self._core.prefix_cache
        stats["prefix_cache"] = asdict(prefix_cache.stats()) if prefix_cache is not None else None
        disk = self._core.disk
        stats["prefix_cache_disk"] = asdict(disk.stats()) if disk is not None else None
        runner = self._core.runner
        stats["vision"] = asdict(runner.vision.counters) if runner is not None else None
        return stats
