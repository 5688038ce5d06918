"""The typed objects passed between Scheduler and Runner each step.

A step is `Scheduler.schedule() -> StepPlan`, `Runner.run(plan) -> StepResult`,
`Scheduler.update(result)`. The plan says what to feed; the result says what
was fed and sampled; only `update` moves requests on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxserve.engine.request import Request, RequestStatus
from mlxserve.engine.restores import DiskRestore
from mlxserve.engine.sampling import SampledRow


@dataclass
class PrefillChunk:
    """Feed prompt_ids[start:end] of `request`; `initial_cache` only on its first chunk.

    `snapshot_after`: copy the cache once it holds prompt_ids[:end] (prefix cache).
    """

    request: Request
    start: int
    end: int
    initial_cache: list[Any] | None = None
    snapshot_after: bool = False

    @property
    def is_last(self) -> bool:
        return self.end == self.request.num_fill

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FinishRule:
    """When a sampled token ends its request (the scheduler's rule, shared with the runner,
    so the run that samples a request's last token can also snapshot its cache)."""

    eos_ids: frozenset[int]
    max_model_len: int | None = None

    def status(self, request: Request, token: int, earlier: int = 0) -> RequestStatus | None:
        """How `request` ends if `token` is appended to its output now, after `earlier`
        tokens of the same step (None: it goes on)."""
        params = request.params
        if not params.ignore_eos and token in self.eos_ids or token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        produced = len(request.output_ids) + earlier + 1
        if produced >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        limit = self.max_model_len
        if limit is not None and request.num_prompt + produced >= limit:
            return RequestStatus.FINISHED_LENGTH
        return None


@dataclass
class StepPlan:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    # Requests that finished (or were aborted) since the last step: free their caches.
    released: list[str] = field(default_factory=list)
    # Of those, (request id, tokens its cache holds) to snapshot first: requests
    # stopped from outside (a stop string) on trimmable caches leave a
    # `prompt + output` prefix-cache entry.
    completed: list[tuple[str, list[int]]] = field(default_factory=list)
    # Requests preempted for memory: drop their caches (they are prefilled again later).
    preempted: list[str] = field(default_factory=list)
    # Set when the prefix cache is on: decode rows whose sampled token ends them
    # leave a `prompt + output` snapshot in the same run (trimmable caches only).
    finish_rule: FinishRule | None = None
    # Prefix-cache entries read from disk: the runner makes a slice of their arrays.
    restores: list[DiskRestore] = field(default_factory=list)
    # Speculative decoding: draft tokens per decode row (every row of a batch, one length).
    drafts: dict[str, list[int]] = field(default_factory=dict)

    @property
    def has_work(self) -> bool:
        return bool(self.prefills or self.decodes or self.restores)

    @property
    def num_tokens(self) -> int:
        """Tokens this step feeds (one per decode row plus the prefill chunks)."""
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def request_ids(self) -> list[str]:
        """Every request this plan touches."""
        ids = [c.request.request_id for c in self.prefills]
        ids += [r.request_id for r in self.decodes]
        ids += [rid for rid, _ in self.completed]
        return list(dict.fromkeys(ids + self.released + self.preempted))


@dataclass
class Snapshot:
    """A real copy of a cache that holds exactly `key_ids`."""

    key_ids: list[int]
    cache: list[Any]


@dataclass
class RequestOutput:
    request_id: str
    sampled: SampledRow | None = None
    # A verify step's further tokens, after `sampled`, in order; `drafted`: drafts verified.
    accepted: list[SampledRow] = field(default_factory=list)
    drafted: int = 0
    error: str | None = None
    snapshot: Snapshot | None = None
    # Prompt tokens the request's cache holds after this step (a prefill chunk ran).
    computed: int | None = None


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    # Wall time of the forwards (through sampling), for the scheduler's pacing:
    # (tokens, seconds) of each prefill chunk's forward, and the decode forwards.
    prefill_chunks: list[tuple[int, float]] = field(default_factory=list)
    decode_s: float = 0.0
    # Restores whose arrays are all made (or that failed): the scheduler stores them.
    restored: list[DiskRestore] = field(default_factory=list)
    # Finished requests whose caches could not be freed (the engine recovers them).
    unreleased: list[str] = field(default_factory=list)
    release_error: str | None = None
