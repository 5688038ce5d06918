"""Admission, prefix-cache lookup, the prefill token budget, and finishing requests.

Pure bookkeeping: it never touches mlx arrays except through the prefix cache's
lookup, which hands back cache objects over a snapshot's buffers (or the
snapshot itself, when this request supersedes it) without copying.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxserve.config import EngineConfig
from mlxserve.engine import faults
from mlxserve.engine.budget import KVBudget
from mlxserve.engine.faults import FaultHook
from mlxserve.engine.pacing import MIN_CHUNK_TOKENS, Pacer
from mlxserve.engine.plan import (
    FinishRule,
    PrefillChunk,
    RequestOutput,
    Snapshot,
    StepPlan,
    StepResult,
)
from mlxserve.engine.prefill_plan import PrefillSizer
from mlxserve.engine.request import Request, RequestStatus, TokenEvent
from mlxserve.engine.restores import Restorer
from mlxserve.engine.sampling import SampledRow
from mlxserve.engine.spec.drafting import Speculator

if TYPE_CHECKING:
    from mlxserve.cache.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

RECENT_STATUS_LIMIT = 4096
# A shared prefix shorter than this is not worth a snapshot of its own.
MIN_BRANCH_TOKENS = 32


def image_positions_held(requests: list[Request]) -> int:
    """Image positions whose features these requests may hold (`Request.feature_positions`):
    the admission counts them as it counts prompt tokens."""
    return sum(request.feature_positions for request in requests)


@dataclass
class SchedulerCounters:
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    preemptions: int = 0
    timeouts: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    generation_tokens: int = 0


class Scheduler:
    """Queues, admission and finishing. Every event it makes goes to `take_events()`.

    Events are collected in an outbox as each request changes state, so an
    exception part way through a step loses none of them: the engine drains
    the outbox after every phase, whether the phase returned or raised.
    """

    def __init__(
        self,
        config: EngineConfig,
        eos_ids: frozenset[int],
        prefix_cache: PrefixCache | None = None,
        memory: KVBudget | None = None,
        fault: FaultHook | None = None,
        min_chunk_tokens: int = MIN_CHUNK_TOKENS,
        wake: Callable[[], None] | None = None,
        num_layers: int = 1,
        speculator: Speculator | None = None,
    ) -> None:
        self.config = config
        self._fault = fault
        self.eos_ids = eos_ids
        self.prefix_cache = prefix_cache
        self.memory = memory
        self._prefix_cache_max = prefix_cache.max_bytes if prefix_cache is not None else 0
        # Bytes the waiting head needs that only other models sharing the KV pool can
        # free (0: none); the engine idles meanwhile, until the pool wakes it.
        self._waiting_for = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.recent_status: OrderedDict[str, RequestStatus] = OrderedDict()
        self.counters = SchedulerCounters()
        self._released: list[str] = []
        self._completed: list[tuple[str, list[int]]] = []
        self._outbox: list[TokenEvent] = []
        self.finish_rule = FinishRule(eos_ids, config.max_model_len)
        # Drafts for the decode rows (speculative decoding; None when off).
        self.speculator = speculator
        self.pacer = Pacer(config.max_step_ms)
        self.sizer = PrefillSizer(self.pacer, min_chunk_tokens, num_layers)
        disk = prefix_cache.disk if prefix_cache is not None else None
        # Requests whose cached prefix is being read back from the disk tier.
        self.restorer = (
            Restorer(disk, prefix_cache, wake)
            if disk is not None and prefix_cache is not None
            else None
        )

    def take_events(self) -> list[TokenEvent]:
        events, self._outbox = self._outbox, []
        return events

    # -- intake -------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.by_id[request.request_id] = request
        self._remember(request)

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Finish a request on the caller's word: aborted, or stopped (a stop string matched)."""
        request = self.by_id.get(request_id)
        if request is None or request.status.is_finished:
            return
        self._unqueue(request)
        self._finish(request, status)

    def fail(self, request_id: str, message: str) -> None:
        request = self.by_id.get(request_id)
        if request is None or request.status.is_finished:
            return
        self._unqueue(request)
        request.error = message
        self._finish(request, RequestStatus.FINISHED_ERROR)

    def _unqueue(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        elif self.restorer is not None:
            self.restorer.remove(request.request_id)

    def fail_all(self, message: str) -> list[str]:
        """Fail every request the scheduler knows; returns their ids."""
        ids = list(self.by_id)
        for request_id in ids:
            self.fail(request_id, message)
        return ids

    # -- planning -----------------------------------------------------------
    def schedule(self) -> StepPlan:
        """One step's plan: free what finished, decode every running request, spend the
        token budget on prefill chunks shortest-prompt-first.

        Shortest-remaining-first lets a short request that arrives behind a long
        prompt be prefilled in the next step instead of after the whole prefill.
        While others decode or wait, the pacer bounds the prefill so the step
        ends on time. Memory comes first: running requests that would outgrow
        the budget preempt the newest, and a waiting request is admitted only
        when it fits. Requests stopped from outside leave their `prompt + output`
        snapshots in this step's run, so admission waits one step for them.
        """
        plan = StepPlan(released=self._released, completed=self._completed)
        self._released, self._completed = [], []
        if self.prefix_cache is not None:
            plan.finish_rule = self.finish_rule
        self._expire()
        self._plan_restores(plan)
        self._preempt_for_memory(plan)
        plan.decodes = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if self.speculator is not None:
            plan.drafts = self.speculator.plan(plan.decodes)
        if not plan.completed:
            self._admit_waiting()
        self._plan_prefills(plan)
        self._fit_prefix_cache()
        self._publish_holding()
        return plan

    def _plan_restores(self, plan: StepPlan) -> None:
        if self.restorer is not None:
            plan.restores, missed = self.restorer.plan()
            for request in reversed(missed):
                self.waiting.appendleft(request)

    def _plan_prefills(self, plan: StepPlan) -> None:
        """Chunks within the token budget and, while others decode or wait, the pacer's time.

        Each chunk is its own forward, with a fixed cost of its own: once a chunk
        is planned, the next one is planned only if it fits in the time left.
        Prompts that all fit in the budget, with nobody decoding, are all fed
        (whole fresh prompts share one forward, see `prefill_group.py`), and a
        prefix-cache hit's suffix that prefills alone goes in two forwards (see
        `PrefillSizer.hit_suffix_tokens` in `prefill_plan.py`).
        """
        prefilling = [r for r in self.running if r.status == RequestStatus.PREFILLING]
        prefilling.sort(key=lambda r: r.prefill_remaining)
        alone = not plan.decodes and len(prefilling) <= 1 and not self.waiting
        tokens = max(1, self.config.max_num_batched_tokens - len(plan.decodes))
        allowance = self.sizer.allowance(tokens, len(plan.decodes), prefilling, alone)
        if alone and prefilling:
            suffix = self.sizer.hit_suffix_tokens(prefilling[0], allowance)
            if suffix is not None:
                plan.prefills.append(self._next_chunk(prefilling[0], suffix))
                return
        for request in prefilling:
            tokens = self.sizer.chunk_tokens(request, allowance, plan.prefills)
            if tokens <= 0:
                break
            chunk = self._next_chunk(request, tokens)
            plan.prefills.append(chunk)
            self.sizer.spend(allowance, chunk.num_tokens)

    def _next_chunk(self, request: Request, budget: int) -> PrefillChunk:
        start = request.num_computed
        end = start + min(budget, request.prefill_remaining)
        end = request.chunk_end(start, end)  # never inside an image fed whole
        # A resumed request also stops at the prompt's end: that is a snapshot point.
        prompt_end = request.num_prompt if request.fill_ids is not None else None
        for boundary in (request.branch_at, prompt_end):
            if boundary is not None and start < boundary < end:
                end = boundary
        snapshot = self.prefix_cache is not None and end in (request.num_prompt, request.branch_at)
        return PrefillChunk(request, start, end, request.cache, snapshot)

    def _expire(self) -> None:
        timeout = self.config.request_timeout_s
        if timeout is None:
            return
        now = time.monotonic()
        restoring = self.restorer.requests() if self.restorer is not None else []
        for request in list(self.waiting) + restoring + list(self.running):
            if now - request.arrival_time > timeout:
                self.counters.timeouts += 1
                if request.output_ids:
                    # Out of time as out of tokens: the client keeps the answer so far
                    # (a preempted request too), and an error would only make its SDK
                    # retry the whole request.
                    self.abort(request.request_id, RequestStatus.FINISHED_LENGTH)
                else:
                    self.fail(request.request_id, f"the request timed out after {timeout:g} s")

    # -- memory ---------------------------------------------------------------
    def _reserve(self, request: Request) -> int:
        left = request.params.max_tokens - len(request.output_ids)
        wanted = self.config.kv_reserve_tokens
        if self.speculator is not None:  # a verify step holds its drafts for a moment
            wanted = max(wanted, self.speculator.max_draft_tokens + 1)
        return max(0, min(wanted, left))

    def _lengths(self, reserve: bool) -> list[int]:
        return [r.cached_len + (self._reserve(r) if reserve else 0) for r in self.running]

    def _held(self, reserve: bool, admitting: Request | None = None) -> int:
        """Bytes the running requests (and one being admitted) may hold: their caches,
        with `reserve` tokens to decode into, and the features of their images."""
        assert self.memory is not None
        lengths = self._lengths(reserve)
        requests = list(self.running)
        if admitting is not None:
            lengths.append(admitting.num_fill + (self._reserve(admitting) if reserve else 0))
            requests.append(admitting)
        return self.memory.held(lengths, image_positions_held(requests))

    def _preempt_for_memory(self, plan: StepPlan) -> None:
        memory = self.memory
        if memory is None:
            return
        while self.running and (held := self._held(False)) > memory.room():
            alone = held > memory.whole_bytes
            if len(self.running) == 1 and (memory.pool is None or alone):
                self.fail(self.running[0].request_id, self._no_room_message())
                return
            # In a shared pool a lone request waits for the other models' caches to shrink.
            self._preempt(max(self.running, key=lambda r: r.arrival_time), plan)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Drop a running request's cache; it waits at the head of the queue to resume."""
        logger.info(
            "preempting request %s (%d tokens) to stay within the KV budget",
            request.request_id,
            request.cached_len,
        )
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.fill_ids = request.prompt_ids + request.output_ids if request.output_ids else None
        request.num_computed = 0
        request.cache = None
        request.branch_at = None
        request.preemptions += 1
        self.waiting.appendleft(request)
        self._remember(request)
        plan.preempted.append(request.request_id)
        self.counters.preemptions += 1

    def _fits(self, request: Request) -> bool:
        memory = self.memory
        if memory is None:
            return True
        return memory.claim(self._held(True, request))

    def _fit_prefix_cache(self, admitting: Request | None = None) -> None:
        """Evict prefix-cache entries until it fits beside the running caches (and gives
        way to what another model waits for)."""
        memory, cache = self.memory, self.prefix_cache
        if memory is None or cache is None:
            return
        room = memory.prefix_room() - self._held(False, admitting)
        cache.set_limit(max(0, min(self._prefix_cache_max, room)))

    def _publish_holding(self) -> None:
        """Tell a shared KV pool what this engine holds after planning the step."""
        memory = self.memory
        if memory is None or memory.pool is None:
            return
        held = self._held(False)
        if self.prefix_cache is not None:
            held += self.prefix_cache.nbytes
        memory.publish(held, self._waiting_for)

    def _no_room_message(self) -> str:
        assert self.memory is not None
        return (
            "the request's KV cache does not fit in the memory budget "
            f"(--kv-memory-bytes {self.memory.whole_bytes})"
        )

    def _admit_waiting(self) -> None:
        self._waiting_for = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            head = self.waiting[0]
            if self.restorer is not None and self.restorer.start(head):
                self.waiting.popleft()  # back at the head once its prefix is in RAM
                continue
            if not self._fits(head):
                if self.running:
                    return  # it waits until running requests free memory
                assert self.memory is not None
                need = self.memory.held([head.num_fill + 1], image_positions_held([head]))
                if need > self.memory.whole_bytes:
                    self.fail(head.request_id, self._no_room_message())
                    continue
                if not self.memory.claim(need):
                    # Other models sharing the pool hold the room: idle until it frees.
                    self._waiting_for = need
                    return
            self.waiting.popleft()
            self._fit_prefix_cache(head)
            try:
                self._admit(head)
            except Exception as e:  # a failing admission fails its request, not the step
                logger.exception("admitting request %s failed", head.request_id)
                self.fail(head.request_id, f"{type(e).__name__}: {e}")

    def _admit(self, request: Request) -> None:
        request.status = RequestStatus.PREFILLING
        self.running.append(request)
        self._remember(request)
        if request.preemptions == 0:
            self.counters.prompt_tokens += request.num_prompt
        self._check(faults.ADMIT, request.request_id)
        if self.prefix_cache is None:
            return
        context = request.context_ids
        # A hit that ends inside an image the model must read whole is not used (the
        # model's own chunks never end there, so such an entry is not expected).
        usable = not request.whole_spans or (
            request.span_around(self.prefix_cache.reusable(context)) is None
        )
        # A fresh prompt snapshots at its end, superseding the entry it extends.
        hit = self.prefix_cache.lookup(context, take=request.fill_ids is None) if usable else None
        if hit is not None:
            request.num_computed = hit.key_len
            if request.preemptions == 0:
                request.cached_tokens = hit.key_len
            request.cache = hit.cache
        shared = self.prefix_cache.shared_prefix_len(context)
        span = request.span_around(shared)
        if span is not None:  # a snapshot point is a chunk's end: never inside an image
            shared = span[0]
        if request.num_computed + MIN_BRANCH_TOKENS <= shared < request.num_prompt:
            request.branch_at = shared

    # -- results ------------------------------------------------------------
    def update(self, result: StepResult) -> None:
        """Apply a step's outputs; one output that cannot be applied fails its request only."""
        self.counters.prefilled_tokens += result.prefill_tokens
        self.pacer.observe(result)
        if self.restorer is not None:
            for job in reversed(result.restored):
                request = self.restorer.finish(job)
                if request is not None:
                    self.waiting.appendleft(request)
        for output in result.outputs:
            try:
                self._apply(output)
            except Exception as e:  # a failing update fails its request, not the step
                logger.exception("applying the output of request %s failed", output.request_id)
                self.fail(output.request_id, f"{type(e).__name__}: {e}")

    def _check(self, phase: str, request_id: str) -> None:
        if self._fault is not None:
            self._fault(phase, [request_id])

    def _apply(self, output: RequestOutput) -> None:
        self._check(faults.UPDATE, output.request_id)
        if output.snapshot is not None and self.prefix_cache is not None:
            self._store(output.request_id, output.snapshot)
        request = self.by_id.get(output.request_id)
        if request is None or request.status.is_finished:
            return
        if output.computed is not None:
            # The runner holds the request's cache now (a hit's cache went into it).
            request.num_computed = output.computed
            request.cache = None
        if output.error is not None:
            request.error = output.error
            self._finish(request, RequestStatus.FINISHED_ERROR)
        elif output.sampled is not None:
            self._accept(request, output.sampled)
            for sampled in output.accepted:  # a verify step's further tokens, in order
                if request.status.is_finished:
                    break
                self._accept(request, sampled)
            if output.drafted and self.speculator is not None:
                self.speculator.observe(request.request_id, output.drafted, len(output.accepted))

    def _store(self, request_id: str, snapshot: Snapshot) -> None:
        """Insert a snapshot; a failure costs the entry (a future hit), never the request."""
        assert self.prefix_cache is not None
        try:
            self._check(faults.INSERT, request_id)
            self.prefix_cache.insert(snapshot.key_ids, snapshot.cache)
        except Exception:  # the answer stands; only this prefix-cache entry is lost
            logger.exception("prefix cache refused a snapshot of %d tokens", len(snapshot.key_ids))

    def _accept(self, request: Request, sampled: SampledRow) -> None:
        """Append a sampled token. A request it ends got its `prompt + output`
        snapshot from the run that sampled it (the same `FinishRule`)."""
        token = sampled.token
        status = self.finish_rule.status(request, token)
        request.status = RequestStatus.RUNNING
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        request.output_ids.append(token)
        self.counters.generation_tokens += 1
        if status == RequestStatus.FINISHED_STOPPED:
            self._finish(request, status, snapshotted=True)  # a stop token is not shown
            return
        if status is not None:
            self._settle(request, status, snapshotted=True)
        self._outbox.append(self._event(request, token, sampled.logprob, sampled.top_logprobs))

    def _finish(self, request: Request, status: RequestStatus, snapshotted: bool = False) -> None:
        """Finish without a further visible token (stop token, abort, error)."""
        self._settle(request, status, snapshotted)
        self._outbox.append(self._event(request, None, None, None))

    def _settle(self, request: Request, status: RequestStatus, snapshotted: bool = False) -> None:
        """End a request. `snapshotted`: the run that sampled its last token took its
        `prompt + output` snapshot already; otherwise (stopped from outside) the next
        run takes it, before its cache is freed."""
        decoding = request.status == RequestStatus.RUNNING
        request.status = status
        self._remember(request)
        self.by_id.pop(request.request_id, None)
        if self.restorer is not None:
            self.restorer.forget(request.request_id)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        # Always released: a preempted request waits without a cache but keeps its sampler.
        self._released.append(request.request_id)
        if request in self.running:
            self.running.remove(request)
            finished_normally = status in (
                RequestStatus.FINISHED_STOPPED,
                RequestStatus.FINISHED_LENGTH,
            )
            if self.prefix_cache is not None and finished_normally and decoding and not snapshotted:
                # The last sampled token was never fed, so the cache holds one fewer.
                key = request.prompt_ids + request.output_ids[:-1]
                self._completed.append((request.request_id, key))
        self.counters.finished += 1
        if status == RequestStatus.FINISHED_ABORTED:
            self.counters.aborted += 1
        elif status == RequestStatus.FINISHED_ERROR:
            self.counters.errors += 1

    def _event(
        self,
        request: Request,
        token: int | None,
        logprob: float | None,
        top: tuple[tuple[int, float], ...] | None,
    ) -> TokenEvent:
        return TokenEvent(
            request_id=request.request_id,
            token_id=token,
            logprob=logprob,
            top_logprobs=top,
            finish_reason=request.status.finish_reason,
            error=request.error,
            prompt_tokens=request.num_prompt,
            cached_tokens=request.cached_tokens,
            completion_tokens=len(request.output_ids),
        )

    def _remember(self, request: Request) -> None:
        self.recent_status[request.request_id] = request.status
        self.recent_status.move_to_end(request.request_id)
        while len(self.recent_status) > RECENT_STATUS_LIMIT:
            self.recent_status.popitem(last=False)

    @property
    def has_released(self) -> bool:
        """Finished requests whose caches the next run frees (or snapshots first)."""
        return bool(self._released or self._completed)

    @property
    def num_waiting(self) -> int:
        restoring = len(self.restorer.pending) if self.restorer is not None else 0
        return len(self.waiting) + restoring

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything now (else the engine waits for a command)."""
        if self.running or self.has_released:
            return True
        if self.waiting and not self._waiting_for:
            return True
        return self.restorer is not None and self.restorer.has_work

    @property
    def num_running(self) -> int:
        return len(self.running)
