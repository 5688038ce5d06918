"""What the status page shows that only the api layer knows: runs in flight, recent errors.

The board is filled by the code paths that already see each request (the
generation route, each token event a run receives, the error responses); the
status route only reads it. Nothing here waits on an engine's owner thread
(docs/architecture.md: "watching costs nothing"). Text of prompts and outputs never reaches it:
a run is counts and times, an error is its route, status and message.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field

# Errors kept for the page, newest last.
MAX_ERRORS = 50
# Messages and user agents are cut to this many characters.
MAX_TEXT = 300
# Time-to-first-token samples kept for the percentiles (seconds of history).
TTFT_WINDOW_S = 60.0
MAX_TTFTS = 4096
# The dialect of each generation route's kind (`RunMeta.kind`).
DIALECTS = {
    "chat": "openai-chat",
    "text": "openai-completions",
    "messages": "anthropic-messages",
    "responses": "openai-responses",
}


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


@dataclass(frozen=True)
class CallInfo:
    """The HTTP request a generation run belongs to (set by the generation route)."""

    board: StatusBoard
    route: str
    kind: str
    user_agent: str


# The generation route's call, read when its run is created.
CURRENT_CALL: ContextVar[CallInfo | None] = ContextVar("mlxserve_status_call", default=None)


@dataclass
class RunRecord:
    """One run in flight, as the api layer sees it: counts and times, no text."""

    id: str
    model: str
    route: str
    dialect: str
    user_agent: str
    prompt_tokens: int
    arrival: float  # monotonic
    started_at: float  # unix time
    cached_tokens: int = 0
    generated_tokens: int = 0
    first_token: float | None = None  # monotonic
    last_token: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first over the time they took."""
        first, last = self.first_token, self.last_token
        if first is None or last is None or self.generated_tokens < 2 or last <= first:
            return None
        return (self.generated_tokens - 1) / (last - first)


@dataclass(frozen=True)
class ErrorRecord:
    time: float  # unix time
    route: str
    status: int
    message: str
    model: str | None = None


@dataclass
class StatusBoard:
    """Runs in flight and recent errors of one server; safe from any thread."""

    started_at: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    _runs: dict[str, RunRecord] = field(default_factory=dict)
    _errors: deque[ErrorRecord] = field(default_factory=lambda: deque(maxlen=MAX_ERRORS))
    _ttfts: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_TTFTS))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    errors_total: int = 0

    def open(
        self, owner: object, call: CallInfo, run_id: str, model: str, prompt: int
    ) -> RunRecord:
        """Register a run; it leaves at `close`, or when `owner` is garbage (a run whose
        response never started)."""
        record = RunRecord(
            id=run_id,
            model=model,
            route=call.route,
            dialect=DIALECTS.get(call.kind, call.kind),
            user_agent=_cut(call.user_agent),
            prompt_tokens=prompt,
            arrival=time.monotonic(),
            started_at=time.time(),
        )
        with self._lock:
            self._runs[run_id] = record
        weakref.finalize(owner, self.close, run_id)
        return record

    def first_token(self, record: RunRecord, now: float) -> None:
        record.first_token = now
        with self._lock:
            self._ttfts.append((now, now - record.arrival))

    def close(self, run_id: str) -> None:
        with self._lock:
            self._runs.pop(run_id, None)

    def runs(self) -> list[RunRecord]:
        with self._lock:
            return list(self._runs.values())

    def error(self, route: str, status: int, message: str, model: str | None = None) -> None:
        record = ErrorRecord(time.time(), route, status, _cut(message), model)
        with self._lock:
            self._errors.append(record)
            self.errors_total += 1

    def errors(self) -> list[ErrorRecord]:
        with self._lock:
            return list(self._errors)

    def recent_ttfts(self, now: float, window_s: float = TTFT_WINDOW_S) -> list[float]:
        """Times to first token of the runs whose first token came in the last `window_s`."""
        with self._lock:
            return [ttft for at, ttft in self._ttfts if now - at <= window_s]

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_mono
