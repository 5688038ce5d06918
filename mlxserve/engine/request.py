"""Typed objects that cross the engine boundary: sampling settings, requests, events."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxserve.models.vision import PromptImage


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the server answers 429 with Retry-After."""


class EngineNotReady(RuntimeError):
    """The model is still loading (or failed to load)."""


class RequestStatus(IntEnum):
    """Lifecycle of a request; every finished state sorts after the running ones."""

    WAITING = 0
    PREFILLING = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class Constraint:
    """Output that must follow a grammar (an llguidance grammar, serialized).

    With `start_after`, the output is free until one of those token ids is
    sampled (the end of a reasoning block); the grammar applies from there.
    """

    grammar: str
    start_after: tuple[int, ...] = ()


# Seeds are 64-bit: signed (as vLLM takes them) or unsigned, folded onto one key.
SEED_LIMIT = 1 << 64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                "temperature must be >= 0",
            ),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 or -1: no top-k filtering)"),
            (
                self.seed is None or -(SEED_LIMIT >> 1) <= self.seed < SEED_LIMIT,
                "seed must be an integer of at most 64 bits",
            ),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        """Whether sampling depends on the tokens generated so far."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True)
class TokenEvent:
    """One step's output for one request, sent from the engine thread to the caller.

    A finishing event carries `finish_reason` (stop, length, abort or error)
    and may or may not carry a last token. `error` holds the message when the
    request failed.
    """

    request_id: str
    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Request:
    """Engine-side state of one request. Owned by the engine thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Prompt tokens already in `cache` (prefix-cache hit + prefill chunks done).
    num_computed: int = 0
    cached_tokens: int = 0
    cache: list[Any] | None = None
    # Where this prompt leaves a prefix it shares with a cached entry: the
    # engine also snapshots there, so the next conversation with that prefix hits.
    branch_at: int | None = None
    error: str | None = None
    first_token_time: float | None = None
    sampler_state: Any = None
    # After a preemption the cache is rebuilt from prompt + output (None: the prompt).
    fill_ids: list[int] | None = None
    preemptions: int = 0
    # Images in the prompt (a model that reads them): their positions in `prompt_ids`
    # hold content-keyed ids past the vocabulary, fed as the image's features.
    images: tuple[PromptImage, ...] = ()
    # A model that reads each image whole in one forward (`VisionTower.whole_images`,
    # DeepSeek-V4: two-way attention inside an image block): the images' spans
    # [start, end). No prefill chunk and no prefix-cache hit ends strictly inside one.
    # (): chunks are cut anywhere.
    whole_spans: tuple[tuple[int, int], ...] = ()

    def span_around(self, position: int) -> tuple[int, int] | None:
        """The whole span that `position` falls strictly inside (None: a chunk may end
        or start there)."""
        for start, end in self.whole_spans:
            if start < position < end:
                return start, end
        return None

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk from `start` that would end at `end` ends: before the span `end`
        would cut, or past it where the chunk starts at that span (one longer than the
        budget goes whole, alone)."""
        span = self.span_around(end)
        if span is None:
            return end
        return span[0] if span[0] > start else span[1]

    def holds_whole_span(self, start: int, end: int) -> bool:
        """Whether context positions [start, end) hold a span that is fed whole."""
        return any(first < end and last > start for first, last in self.whole_spans)

    def token_ids(self, ids: list[int]) -> list[int]:
        """`ids` (from this request's context) without its image positions' keyed ids:
        what penalties and prompt-lookup drafts may read as text."""
        if not self.images:
            return ids
        from mlxserve.models.vision import IMAGE_KEY_BASE

        return [t for t in ids if t < IMAGE_KEY_BASE]

    @property
    def feature_positions(self) -> int:
        """Image positions whose features the runner may hold for this request: each image
        its prefill has not passed (the runner keeps an image's features from the chunk
        that first reaches it until a chunk passes its end)."""
        if self.status == RequestStatus.RUNNING:
            return 0
        return sum(image.length for image in self.images if image.end > self.num_computed)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def context_ids(self) -> list[int]:
        """The tokens prefill feeds: the prompt, or prompt + output after a preemption."""
        return self.prompt_ids if self.fill_ids is None else self.fill_ids

    @property
    def num_fill(self) -> int:
        return len(self.context_ids)

    @property
    def prefill_remaining(self) -> int:
        return self.num_fill - self.num_computed

    @property
    def cached_len(self) -> int:
        """Tokens this request's cache holds once the next step has run."""
        if self.status == RequestStatus.RUNNING:
            return self.num_prompt + len(self.output_ids)
        return self.num_fill
