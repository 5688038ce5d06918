"""EngineCore: the one thread that loads the model and makes every MLX call.

MLX streams live in the thread that created them, so the thread that loads the
model is the thread that steps it, for the life of the process. A step is
three calls: `Scheduler.schedule() -> StepPlan`, `Runner.run(plan) -> StepResult`,
`Scheduler.update(result)`.

No request is ever left waiting (rules 2 and 8 of docs/architecture.md): events leave after
every phase, a phase that raises fails exactly the requests it touched, and
if the thread ends for any reason but a stop, `on_death` is told so that the
caller can fail every open request and report the engine as dead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import mlx.core as mx

from mlxserve.cache.arrays import cache_nbytes
from mlxserve.config import EngineConfig
from mlxserve.engine import faults
from mlxserve.engine.budget import CacheCost, KVBudget, KVPool, default_kv_budget, weights_nbytes
from mlxserve.engine.constraint import ConstraintError
from mlxserve.engine.distributed.group import PeerLost
from mlxserve.engine.faults import FaultHook
from mlxserve.engine.plan import StepPlan
from mlxserve.engine.request import Request, RequestStatus, TokenEvent
from mlxserve.engine.runner import Runner
from mlxserve.engine.scheduler import Scheduler
from mlxserve.engine.spec.drafting import Speculator, make_speculator
from mlxserve.engine.spec.mtp_drafter import MtpDrafter
from mlxserve.models.deepseek_v4.mtp import load_mtp_head, require_mtp_weights
from mlxserve.models.loaded import LoadedModel, ModelLoadError
from mlxserve.models.quantized_cache import apply_kv_quant

if TYPE_CHECKING:
    from mlxserve.cache.disk_tier import DiskTier
    from mlxserve.cache.prefix_cache import PrefixCache
    from mlxserve.engine.distributed.publisher import PlanPublisher

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
# How long a stop waits for the disk tier's writes.
DISK_CLOSE_TIMEOUT_S = 60.0
# Rank 0 of a distributed server waits no longer than this for its engine thread at
# shutdown: with a peer gone, a thread inside a collective never returns, and the
# process leaves by os._exit whatever the thread does (the other ranks then see the
# group fail and exit too).
DISTRIBUTED_STOP_TIMEOUT_S = 2.0
T = TypeVar("T")


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _Abort:
    request_id: str
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


class _Stop:
    pass


class EngineStalled(RuntimeError):
    """A step outlived the watchdog; the engine has been reported dead."""


class _Wake:
    """Nothing to apply: a step may have work (a disk read finished)."""


EmitFn = Callable[[list[TokenEvent]], None]


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class EngineCore:
    """Owns the model thread. `emit` receives events (on the engine thread) as phases end."""

    def __init__(
        self,
        config: EngineConfig,
        loader: Callable[[], LoadedModel],
        emit: EmitFn,
        fault: FaultHook | None = None,
        on_death: Callable[[str], None] | None = None,
        pool: KVPool | None = None,
        member: str = "",
        publisher: PlanPublisher | None = None,
    ) -> None:
        self.config = config
        # Distributed serving: each step's plan goes to the other ranks first.
        self.publisher = publisher
        self._loader = loader
        # The KV byte budget shared with the other models' engines (several models served).
        self._pool = pool
        self._member = member
        self._emit = emit
        self._fault = fault
        self._on_death = on_death
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop | _Wake] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="mlxserve-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="mlxserve-watchdog", daemon=True)
        self._stopping = threading.Event()
        # When the step in progress began (None between steps), for the watchdog.
        self._step_started: float | None = None
        self.stalled = False
        self._count_lock = threading.Lock()
        self._pending_adds = 0
        self.ready = threading.Event()
        self.load_error: str | None = None
        # Why the engine thread ended, when it ended for any reason but a stop.
        self.failure: str | None = None
        self.model: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self.runner: Runner | None = None
        self.prefix_cache: PrefixCache | None = None
        self.memory: KVBudget | None = None
        self.steps = 0
        # Seconds the last step with work took, and their moving average (status page).
        self.last_step_s = 0.0
        self.step_s = 0.0
        # The model's weight bytes (an MTP head's included), once measured.
        self.weight_bytes = 0
        # KV cache bytes of the requests in flight, after the last step (engine thread).
        self.kv_bytes = 0
        self.cache_bytes = 0
        self.peak_cache_bytes = 0
        self.mlx_active_bytes = 0
        self.mlx_cache_bytes = 0
        self.mlx_peak_bytes = 0

    # -- called from other threads -----------------------------------------
    def start(self) -> None:
        self._thread.start()
        if self.config.step_timeout_s is not None:
            self._watchdog.start()

    def add(self, request: Request) -> None:
        with self._count_lock:
            self._pending_adds += 1
        self._inbox.put(_Add(request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def finish(self, request_id: str) -> None:
        """End a request as a normal stop (the caller matched a stop string)."""
        self._inbox.put(_Abort(request_id, RequestStatus.FINISHED_STOPPED))

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(_Stop())
        if self.stalled:
            return  # its thread is stuck in a step: nothing to wait for
        if self.publisher is not None:
            timeout = min(timeout, DISTRIBUTED_STOP_TIMEOUT_S)
        if self._thread.is_alive():
            # At shutdown the disk tier writes what RAM holds that it does not.
            self._thread.join(timeout + (DISK_CLOSE_TIMEOUT_S if self.disk is not None else 0))

    @property
    def pending_adds(self) -> int:
        """Requests submitted that the engine thread has not taken in yet."""
        return self._pending_adds

    @property
    def disk(self) -> DiskTier | None:
        """The prefix cache's disk tier, when `--prefix-cache-dir` turned it on."""
        return self.prefix_cache.disk if self.prefix_cache is not None else None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the engine thread --------------------------------------------------
    def _main(self) -> None:
        try:
            self._serve()
        finally:
            # MLX wants each thread that ran its work to drop its streams before
            # it ends; otherwise the process may abort at exit ("terminate
            # called without an active exception").
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            self._load()
        except Exception as e:  # the load error is reported through /health
            logger.exception("model load failed")
            self.load_error = _describe(e)
            self.ready.set()
            self._drain_after_failure()
            return
        self.ready.set()
        stopped = False
        reason = "the engine thread ended"
        try:
            self._loop()
            stopped = True
            self._close_disk()
            if self.publisher is not None and not self.publisher.stop():
                # A rank was lost as the server stopped: not a clean stop.
                self.failure = "another rank was lost"
        except EngineStalled as e:  # the watchdog has reported it already
            reason = str(e)
        except PeerLost as e:  # another rank is gone: not a bug here, no traceback
            reason = str(e)
            logger.critical("the engine stopped: %s", reason)
        except BaseException as e:  # any end but a stop is reported (below)
            reason = _describe(e)
            logger.critical("the engine thread died: %s", reason, exc_info=True)
        finally:
            if not stopped:
                self._die(reason)

    def _load(self) -> None:
        started = time.monotonic()
        model = apply_kv_quant(self._loader(), self.config.kv_quant)
        self.model = model
        if self.config.prefix_cache:
            from mlxserve.cache.prefix_cache import PrefixCache

            self.prefix_cache = PrefixCache(
                self.config.prefix_cache_budget,
                self.config.prefix_cache_entries,
                disk=self._open_disk(model),
                disk_every=self.config.prefix_cache_disk_every,
            )
        publisher = self.publisher
        # Other ranks feed rank 0's tokens, so no step may feed its own draws ahead.
        self.runner = Runner(model, self._fault, decode_ahead=publisher is None)
        if publisher is not None and self.prefix_cache is not None:
            self.prefix_cache.observer = publisher
        # Built beside the memory probe, so no step (and no request) waits for it.
        self.runner.grammar.prepare()
        # Before the budget is measured: an MTP head's weights come out of it.
        speculator = self._speculator(model, self.runner)
        self.memory = self._measure_memory(model, self.runner)
        self._await_grammar(self.runner)
        self.scheduler = Scheduler(
            self.config,
            model.eos_token_ids,
            self.prefix_cache,
            self.memory,
            self._fault,
            min_chunk_tokens=model.min_prefill_chunk,
            wake=lambda: self._inbox.put(_Wake()),
            num_layers=len(model.make_cache()),
            speculator=speculator,
        )
        logger.info("engine ready in %.1f s", time.monotonic() - started)

    @staticmethod
    def _await_grammar(runner: Runner) -> None:
        """Ready only once the grammar tokenizer is: a model without one still serves."""
        try:
            runner.grammar.get()
        except ConstraintError as e:
            logger.info("structured output is not available for this model: %s", e)

    def _speculator(self, model: LoadedModel, runner: Runner) -> Speculator | None:
        """The drafter for `--speculative`, where this model's caches can be cut back:
        the checkpoint's MTP head for `mtp` (refused without one) and for `auto`
        where it has one, prompt lookup otherwise."""
        c = self.config
        mtp = self._mtp_drafter(model) if c.speculative in ("mtp", "auto") else None
        if mtp is not None:
            speculator: Speculator | None = Speculator(mtp, c.num_draft_tokens)
        else:
            mode = "ngram" if c.speculative == "auto" else c.speculative
            speculator = make_speculator(mode, c.num_draft_tokens, c.ngram_size)
        if speculator is None:
            return None
        if runner.verify.rows_limit == 0:
            logger.warning(
                "speculative decoding is off for %s: its caches cannot be cut back after "
                "a verify forward yet",
                model.model_type,
            )
            return None
        speculator.max_rows = runner.verify.rows_limit
        runner.tap.drafter = mtp
        return speculator

    def _mtp_drafter(self, model: LoadedModel) -> MtpDrafter | None:
        head = load_mtp_head(model)
        if head is None and self.config.speculative == "mtp":
            require_mtp_weights(model.path, model.config)  # raises, with the reason
        return None if head is None else MtpDrafter(head)

    def _open_disk(self, model: LoadedModel) -> DiskTier | None:
        """The prefix cache's disk tier, if `--prefix-cache-dir` is set."""
        folder = self.config.prefix_cache_dir
        if folder is None:
            return None
        from mlxserve.cache.disk_tier import DiskTier
        from mlxserve.cache.signature import model_signature

        signature = model_signature(
            model.path, model.config, model.make_cache(), self.config.kv_quant
        )
        return DiskTier(Path(folder), self.config.prefix_cache_disk_bytes, signature)

    def _close_disk(self) -> None:
        """At a stop: write what only RAM holds, then wait for the writer."""
        cache, disk = self.prefix_cache, self.disk
        if cache is None or disk is None:
            return
        try:
            written = cache.flush_to_disk()
            logger.info("writing %d prefix-cache entries to disk before exit", written)
            disk.close(DISK_CLOSE_TIMEOUT_S)
        except Exception:  # the process is stopping; what was written stays usable
            logger.exception("closing the prefix cache's disk tier failed")

    def _measure_memory(self, model: LoadedModel, runner: Runner) -> KVBudget:
        """The KV byte budget and this model's measured cache cost: a share of the
        pool several models' engines hold together, or this engine's own budget."""
        if self.publisher is not None:
            # The other ranks sleep until rank 0, loaded, runs the probe's forwards with them.
            self.publisher.group.meet()
        cost = self._probe_cost(runner)
        self.weight_bytes = weights_nbytes(getattr(model.model, "module", model.model))
        if runner.tap.drafter is not None:  # the MTP head's own weights
            self.weight_bytes += weights_nbytes(runner.tap.drafter.head.drafter)
        # A vision checkpoint's image features, held while their prompt prefills.
        features = model.vision.feature_bytes_per_position() if model.vision else 0
        if self._pool is None:
            return KVBudget(self._own_budget(cost), cost, runner.batchable, None, "", features)
        pool = self._pool
        pool.join(self._member, self.weight_bytes, lambda: self._inbox.put(_Wake()))
        logger.info(
            "model %r shares a KV memory budget of %d bytes; its cache costs "
            "%d + %.0f bytes per token",
            self._member,
            pool.total_bytes,
            cost.fixed_bytes,
            cost.bytes_per_token,
        )
        return KVBudget(pool.total_bytes, cost, runner.batchable, pool, self._member, features)

    @staticmethod
    def _probe_cost(runner: Runner) -> CacheCost:
        """Measured once per checkpoint and setting in this process (`measured_once`).
        A model the probe cannot drive is refused: serving it without a byte budget
        would let memory run out instead of answering (rule 9 of docs/architecture.md)."""
        try:
            return runner.probe_cost(reuse=True)
        except Exception as e:  # reported as the load error (/health, the log)
            raise ModelLoadError(
                f"could not measure this model's KV cache size, so it cannot be served "
                f"within a memory budget: {_describe(e)}"
            ) from e
        finally:
            mx.clear_cache()

    def _own_budget(self, cost: CacheCost) -> int:
        """--kv-memory-bytes, else the device's memory less the weights and a margin;
        under `--distributed`, no more than the tightest rank can hold."""
        budget = self.config.kv_memory_bytes
        source = "--kv-memory-bytes"
        if budget is None:
            budget = default_kv_budget(self.weight_bytes)
            source = (
                f"device memory minus {self.weight_bytes / 2**30:.2f} GiB of weights and a margin"
            )
        if self.publisher is not None:
            from mlxserve.engine.distributed.group import shared_budget

            budget = shared_budget(self.publisher.group, budget, cost.bytes_per_token)
            source += ", the smallest any rank can afford"
        logger.info(
            "KV memory budget %d bytes (%.2f GiB, %s); a request's cache costs "
            "%d + %.0f bytes per token",
            budget,
            budget / 2**30,
            source,
            cost.fixed_bytes,
            cost.bytes_per_token,
        )
        return budget

    def _loop(self) -> None:
        scheduler, runner = self.scheduler, self.runner
        assert scheduler is not None and runner is not None
        disk = self.disk
        while True:
            # Finished requests are freed by the next run: step once more before idling.
            idle = not scheduler.has_work
            if idle and disk is not None:
                disk.pump(flush=True)  # nothing will compute: hand every staged write over
            if not self._handle_commands(block=idle):
                return
            steps, started = self.steps, time.monotonic()
            self._step_started = started
            try:
                self._step(scheduler, runner)
                if disk is not None:
                    self._guarded(disk.pump, lambda: [])
            finally:
                self._step_started = None
                if self.steps != steps:
                    self._time_step(time.monotonic() - started)
            if self.stalled:
                raise EngineStalled(self.failure or "engine stalled")

    def _time_step(self, seconds: float) -> None:
        self.last_step_s = seconds
        self.step_s = seconds if self.step_s == 0.0 else 0.9 * self.step_s + 0.1 * seconds

    def _step(self, scheduler: Scheduler, runner: Runner) -> None:
        """One step: schedule -> run -> update; its events go out as the update ends.

        A phase that raises fails the requests it touched and the step ends
        there; a run that could not free finished requests has them recovered.
        """
        plan = self._guarded(
            lambda: self._schedule(scheduler),
            lambda: [r.request_id for r in [*scheduler.running, *scheduler.waiting]],
        )
        if plan is None:
            return
        if plan.has_work:
            self.steps += 1
        if self.publisher is not None:
            # Not guarded: a peer gone (PeerLost) is engine death, not a request's error.
            self.publisher.publish(plan, [*scheduler.running, *scheduler.waiting])
        result = self._guarded(lambda: runner.run(plan), lambda: plan.request_ids)
        if result is not None and self.publisher is not None:
            self.publisher.ran(plan, result)
        if result is not None:
            self._guarded(lambda: scheduler.update(result), lambda: plan.request_ids)
            if result.unreleased:
                self._recover(result.unreleased, result.release_error or "release failed")
        self._measure(scheduler, runner)

    def _schedule(self, scheduler: Scheduler) -> StepPlan:
        if self._fault is not None:
            self._fault(faults.SCHEDULE, [r.request_id for r in scheduler.running])
        return scheduler.schedule()

    def _guarded(self, work: Callable[[], T], touched: Callable[[], list[str]]) -> T | None:
        """Run one phase; if it raises, fail the requests it touched. Emit what it produced."""
        try:
            return work()
        except Exception as e:  # a failing step fails its requests, not the engine
            logger.exception("engine step failed; failing the requests it touched")
            self._recover(touched(), _describe(e))
            return None
        finally:
            self._flush()

    def _recover(self, request_ids: list[str], message: str) -> None:
        """Fail these requests and free their state. If that fails too, every request
        fails and the runner starts clean: a step's failure never ends the engine."""
        scheduler, runner = self.scheduler, self.runner
        assert scheduler is not None and runner is not None
        try:
            if self._fault is not None:
                self._fault(faults.RECOVER, request_ids)
            for request_id in request_ids:
                scheduler.fail(request_id, message)
            runner.release(request_ids)
        except Exception:  # the batch may be inconsistent now: start from a clean runner
            logger.exception("recovering from a failed step failed; resetting the runner")
            scheduler.fail_all(message)
            runner.reset()
        finally:
            mx.clear_cache()

    def _flush(self) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        events = scheduler.take_events()
        if events:
            self._emit(events)

    def _measure(self, scheduler: Scheduler, runner: Runner) -> None:
        """What the caches hold now: live caches, pending hit copies and the prefix cache.
        A failure here keeps the last figures; it never fails a request or the engine."""
        try:
            held = runner.live_bytes()
            self.kv_bytes = held
            pending = [r.cache for r in scheduler.running if r.cache is not None]
            if pending:
                held += cache_nbytes(pending)
            if self.prefix_cache is not None:
                held += self.prefix_cache.nbytes
        except Exception:  # a gauge, not a step: the figures wait for the next step
            logger.exception("measuring the caches' bytes failed")
            return
        self.cache_bytes = held
        self.peak_cache_bytes = max(self.peak_cache_bytes, held)
        if self._pool is not None:
            self._pool.measured(self._member, held)
        # What MLX's allocator holds: arrays alive, and freed buffers kept for reuse.
        self.mlx_active_bytes = int(mx.get_active_memory())
        self.mlx_cache_bytes = int(mx.get_cache_memory())
        self.mlx_peak_bytes = int(mx.get_peak_memory())

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued adds/aborts; False when asked to stop."""
        scheduler = self.scheduler
        assert scheduler is not None
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        try:
            while True:
                if isinstance(command, _Stop):
                    for request in [*scheduler.waiting, *scheduler.running]:
                        scheduler.abort(request.request_id)
                    return False
                if isinstance(command, _Add):
                    with self._count_lock:
                        self._pending_adds -= 1
                    scheduler.add(command.request)
                elif isinstance(command, _Abort):
                    scheduler.abort(command.request_id, command.status)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    return True
        finally:
            self._flush()

    def _watch(self) -> None:
        """The step watchdog: a step that runs past `step_timeout_s` is engine death."""
        timeout = self.config.step_timeout_s
        assert timeout is not None
        while not self._stopping.wait(min(1.0, timeout / 4)):
            started = self._step_started
            if started is None or time.monotonic() - started <= timeout or self.failure:
                continue
            reason = f"engine stalled: a step has run for more than {timeout:g} s"
            logger.critical("%s; failing every open request", reason)
            self.stalled = True
            self.failure = reason
            if self._on_death is not None:
                self._on_death(reason)
            return

    def _die(self, reason: str) -> None:
        """The loop ended without a stop: fail every request it knew, tell the owner."""
        self.failure = reason
        message = f"the engine failed: {reason}"
        try:
            if self.scheduler is not None:
                self.scheduler.fail_all(message)
            if self.runner is not None:
                self.runner.reset()  # free the caches before the clients hear
            if self.scheduler is not None:
                self._flush()
        except Exception:  # the owner's on_death still fails every open request
            logger.exception("failing the open requests of a dead engine failed")
        if self._on_death is not None:
            self._on_death(reason)

    def _drain_after_failure(self) -> None:
        """Without a model, answer every request with the load error until stopped."""
        while True:
            command = self._inbox.get()
            if isinstance(command, _Stop):
                return
            if isinstance(command, _Add):
                with self._count_lock:
                    self._pending_adds -= 1
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
