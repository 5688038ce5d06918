"""EngineCore: the one thread that loads the model and makes every MLX call.

MLX streams live in the thread that created them, so the thread that loads the
model is the thread that steps it, for the life of the process. The loop is
three named phases: schedule -> run -> update.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxserve.config import EngineConfig
from mlxserve.engine.request import Request, RequestStatus, TokenEvent
from mlxserve.engine.runner import Runner
from mlxserve.engine.scheduler import Scheduler
from mlxserve.models.loaded import LoadedModel

if TYPE_CHECKING:
    from mlxserve.cache.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


EmitFn = Callable[[list[TokenEvent]], None]


class EngineCore:
    """Owns the model thread. `emit` receives each step's events (on the engine thread)."""

    def __init__(
        self, config: EngineConfig, loader: Callable[[], LoadedModel], emit: EmitFn
    ) -> None:
        self.config = config
        self._loader = loader
        self._emit = emit
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="mlxserve-engine", daemon=True)
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.model: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self.runner: Runner | None = None
        self.prefix_cache: PrefixCache | None = None
        self.steps = 0
        # KV cache bytes of the requests in flight, after the last step (engine thread).
        self.kv_bytes = 0

    # -- called from other threads -----------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add(self, request: Request) -> None:
        self._inbox.put(_Add(request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def inbox_size(self) -> int:
        return self._inbox.qsize()

    # -- the engine thread --------------------------------------------------
    def _main(self) -> None:
        try:
            self._load()
        except Exception as e:  # the load error is reported through /health
            logger.exception("model load failed")
            self.load_error = f"{type(e).__name__}: {e}"
            self.ready.set()
            self._drain_after_failure()
            return
        self.ready.set()
        self._loop()

    def _load(self) -> None:
        started = time.monotonic()
        model = self._loader()
        self.model = model
        if self.config.prefix_cache:
            from mlxserve.cache.prefix_cache import PrefixCache

            self.prefix_cache = PrefixCache(
                self.config.prefix_cache_budget, self.config.prefix_cache_entries
            )
        self.scheduler = Scheduler(self.config, model.eos_token_ids, self.prefix_cache)
        self.runner = Runner(model)
        logger.info("engine ready in %.1f s", time.monotonic() - started)

    def _loop(self) -> None:
        scheduler, runner = self.scheduler, self.runner
        assert scheduler is not None and runner is not None
        while True:
            idle = not scheduler.running and not scheduler.waiting
            if not self._handle_commands(block=idle):
                return
            try:
                events = self._step(scheduler, runner)
            except Exception as e:  # a failing step fails its requests, not the engine
                logger.exception("engine step failed; failing the running requests")
                events = self._fail_running(f"{type(e).__name__}: {e}")
            if events:
                self._emit(events)

    def _step(self, scheduler: Scheduler, runner: Runner) -> list[TokenEvent]:
        """One step in two phases; returns the second phase's events.

        Phase one decodes and finishes short prompts; its tokens go out before
        phase two feeds the partial chunks of long prompts, so streaming clients
        do not wait for a long prefill chunk to see their next token.
        """
        plan = scheduler.schedule()
        if plan.has_work:
            self.steps += 1
        first, second = plan.split_partial_prefills()
        events = scheduler.update(runner.run(first))
        if second.has_work:
            if events:
                self._emit(events)
            events = scheduler.update(runner.run(second))
        # Free finished requests now, so their `prompt + output` snapshots are in
        # the prefix cache before the next request is admitted.
        released = scheduler.take_released()
        if released.released:
            scheduler.update(runner.run(released))
        if plan.has_work or released.released:
            self.kv_bytes = runner.kv_bytes()
        return events

    def _fail_running(self, message: str) -> list[TokenEvent]:
        scheduler, runner = self.scheduler, self.runner
        assert scheduler is not None and runner is not None
        events: list[TokenEvent] = []
        failed = [request.request_id for request in scheduler.running]
        for request_id in failed:
            events.extend(scheduler.fail(request_id, message))
        runner.release(failed)
        return events

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued adds/aborts; False when asked to stop."""
        scheduler = self.scheduler
        assert scheduler is not None
        events: list[TokenEvent] = []
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                self._abort_all(events)
                if events:
                    self._emit(events)
                return False
            if isinstance(command, _Add):
                scheduler.add(command.request)
            else:
                events.extend(scheduler.abort(command.request_id))
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
        if events:
            self._emit(events)
        return True

    def _abort_all(self, events: list[TokenEvent]) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        for request in list(scheduler.waiting) + list(scheduler.running):
            events.extend(scheduler.abort(request.request_id))

    def _drain_after_failure(self) -> None:
        """Without a model, answer every request with the load error until stopped."""
        while True:
            command = self._inbox.get()
            if isinstance(command, _Stop):
                return
            if isinstance(command, _Add):
                request = command.request
                request.status = RequestStatus.FINISHED_ERROR
                self._emit(
                    [
                        TokenEvent(
                            request.request_id,
                            None,
                            finish_reason="error",
                            error=f"model failed to load: {self.load_error}",
                            prompt_tokens=request.num_prompt,
                        )
                    ]
                )
