"""Admission, prefix-cache lookup, the prefill token budget, and finishing requests.

Pure bookkeeping: it never touches mlx arrays except through the prefix cache's
lookup, which hands back a private copy of a snapshot.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxserve.config import EngineConfig
from mlxserve.engine.plan import PrefillChunk, Snapshot, StepPlan, StepResult
from mlxserve.engine.request import Request, RequestStatus, TokenEvent
from mlxserve.engine.sampling import SampledRow

if TYPE_CHECKING:
    from mlxserve.cache.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

RECENT_STATUS_LIMIT = 4096
# A shared prefix shorter than this is not worth a snapshot of its own.
MIN_BRANCH_TOKENS = 32


@dataclass
class SchedulerCounters:
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    generation_tokens: int = 0


class Scheduler:
    def __init__(
        self, config: EngineConfig, eos_ids: frozenset[int], prefix_cache: PrefixCache | None = None
    ) -> None:
        self.config = config
        self.eos_ids = eos_ids
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.recent_status: OrderedDict[str, RequestStatus] = OrderedDict()
        self.counters = SchedulerCounters()
        self._released: list[str] = []
        self._completed: list[tuple[str, list[int]]] = []

    # -- intake -------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.by_id[request.request_id] = request
        self._remember(request)

    def abort(self, request_id: str) -> list[TokenEvent]:
        request = self.by_id.get(request_id)
        if request is None or request.status.is_finished:
            return []
        if request in self.waiting:
            self.waiting.remove(request)
        return [self._finish(request, RequestStatus.FINISHED_ABORTED)]

    def fail(self, request_id: str, message: str) -> list[TokenEvent]:
        request = self.by_id.get(request_id)
        if request is None or request.status.is_finished:
            return []
        request.error = message
        return [self._finish(request, RequestStatus.FINISHED_ERROR)]

    # -- planning -----------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Decode every running request; spend the prefill budget shortest-prompt-first.

        Shortest-remaining-first lets a short request that arrives behind a long
        prompt be prefilled in the next step instead of after the whole prefill.
        """
        plan = self.take_released()
        plan.decodes = [r for r in self.running if r.status == RequestStatus.RUNNING]
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            self._admit(self.waiting.popleft())
        prefilling = [r for r in self.running if r.status == RequestStatus.PREFILLING]
        prefilling.sort(key=lambda r: r.prefill_remaining)
        budget = self.config.max_prefill_tokens
        for request in prefilling:
            if budget <= 0:
                break
            start = request.num_computed
            end = start + min(budget, request.prefill_remaining)
            branch = request.branch_at
            if branch is not None and start < branch < end:
                end = branch
            snapshot = self.prefix_cache is not None and (
                end == request.num_prompt or end == branch
            )
            plan.prefills.append(PrefillChunk(request, start, end, request.cache, snapshot))
            request.cache = None
            request.num_computed = end
            budget -= end - start
        return plan

    def take_released(self) -> StepPlan:
        """A plan that only frees (and snapshots) what finished since the last plan."""
        plan = StepPlan(released=self._released, completed=self._completed)
        self._released, self._completed = [], []
        return plan

    def _admit(self, request: Request) -> None:
        request.status = RequestStatus.PREFILLING
        self.running.append(request)
        self._remember(request)
        self.counters.prompt_tokens += request.num_prompt
        if self.prefix_cache is None:
            return
        hit = self.prefix_cache.lookup(request.prompt_ids)
        if hit is not None:
            request.num_computed = hit.key_len
            request.cached_tokens = hit.key_len
            request.cache = hit.cache
        shared = self.prefix_cache.shared_prefix_len(request.prompt_ids)
        if request.num_computed + MIN_BRANCH_TOKENS <= shared < request.num_prompt:
            request.branch_at = shared

    # -- results ------------------------------------------------------------
    def update(self, result: StepResult) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        self.counters.prefilled_tokens += result.prefill_tokens
        for output in result.outputs:
            if output.snapshot is not None and self.prefix_cache is not None:
                self._store(output.snapshot)
            request = self.by_id.get(output.request_id)
            if request is None or request.status.is_finished:
                continue
            if output.error is not None:
                request.error = output.error
                events.append(self._finish(request, RequestStatus.FINISHED_ERROR))
            elif output.sampled is not None:
                events.append(self._accept(request, output.sampled))
        return events

    def _store(self, snapshot: Snapshot) -> None:
        assert self.prefix_cache is not None
        try:
            self.prefix_cache.insert(snapshot.key_ids, snapshot.cache)
        except ValueError:
            # A snapshot whose size disagrees with its key is a bug; serving goes on.
            logger.exception("prefix cache refused a snapshot of %d tokens", len(snapshot.key_ids))

    def _accept(self, request: Request, sampled: SampledRow) -> TokenEvent:
        token = sampled.token
        params = request.params
        request.status = RequestStatus.RUNNING
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        request.output_ids.append(token)
        self.counters.generation_tokens += 1
        if not params.ignore_eos and token in self.eos_ids or token in params.stop_token_ids:
            return self._finish(request, RequestStatus.FINISHED_STOPPED)
        status = None
        total = request.num_prompt + len(request.output_ids)
        if len(request.output_ids) >= params.max_tokens or (
            self.config.max_model_len is not None and total >= self.config.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._settle(request, status)
        return self._event(request, token, sampled.logprob, sampled.top_logprobs)

    def _finish(self, request: Request, status: RequestStatus) -> TokenEvent:
        """Finish without a further visible token (stop token, abort, error)."""
        self._settle(request, status)
        return self._event(request, None, None, None)

    def _settle(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._remember(request)
        self.by_id.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
            self._released.append(request.request_id)
            finished_normally = status in (
                RequestStatus.FINISHED_STOPPED,
                RequestStatus.FINISHED_LENGTH,
            )
            if self.prefix_cache is not None and finished_normally and request.output_ids:
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
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
