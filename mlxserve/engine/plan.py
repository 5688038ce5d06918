"""The typed objects passed between Scheduler and Runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxserve.engine.request import Request
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


@dataclass
class StepPlan:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    # Requests that finished (or were aborted) since the last step: free their caches.
    released: list[str] = field(default_factory=list)
    # Of those, (request id, tokens its cache holds) to snapshot first: finished
    # requests on trimmable caches leave a `prompt + output` prefix-cache entry.
    completed: list[tuple[str, list[int]]] = field(default_factory=list)
    # Requests preempted for memory: drop their caches (they are prefilled again later).
    preempted: list[str] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.prefills or self.decodes)

    @property
    def request_ids(self) -> list[str]:
        """Every request this plan touches."""
        ids = [c.request.request_id for c in self.prefills]
        ids += [r.request_id for r in self.decodes]
        ids += [rid for rid, _ in self.completed]
        return list(dict.fromkeys(ids + self.released + self.preempted))

    def split_partial_prefills(self) -> tuple[StepPlan, StepPlan]:
        """(everything that yields tokens now, the chunks that leave a prompt unfinished)."""
        partial = [chunk for chunk in self.prefills if not chunk.is_last]
        if not partial:
            return self, StepPlan()
        finishing = [chunk for chunk in self.prefills if chunk.is_last]
        first = StepPlan(finishing, self.decodes, self.released, self.completed, self.preempted)
        return first, StepPlan(prefills=partial)


@dataclass
class Snapshot:
    """A real copy of a cache that holds exactly `key_ids`."""

    key_ids: list[int]
    cache: list[Any]


@dataclass
class RequestOutput:
    request_id: str
    sampled: SampledRow | None = None
    error: str | None = None
    snapshot: Snapshot | None = None


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
