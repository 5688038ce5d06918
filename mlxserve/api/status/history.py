"""The last 15 minutes for the page's plots: one sample a second, in a ring buffer.

A task on the event loop reads each engine's `stats()` (attributes and
counters the engines already keep; no call waits on an owner thread) and the
status board once a second. Rates and ratios are differences between samples:
generated tokens/s over the last second, the prefix-cache hit ratio and the
TTFT percentiles over the last minute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mlxserve.api.status.board import StatusBoard

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
HISTORY_S = 15 * 60
# The hit ratio and TTFT percentiles of a sample cover this many seconds before it.
WINDOW_S = 60


@dataclass(frozen=True)
class Totals:
    """What every engine counts together, at one moment."""

    generated: int = 0
    hits: int = 0
    misses: int = 0
    running: int = 0
    waiting: int = 0
    kv_used_bytes: int = 0
    kv_budget_bytes: int = 0


def engine_totals(stats: Sequence[dict[str, Any]]) -> Totals:
    """Sum several engines' `stats()`; engines sharing a KV pool share its budget once."""
    budget, pooled = 0, 0
    for s in stats:
        pool = s.get("kv_pool")
        if pool:
            pooled = max(pooled, int(pool.get("budget_bytes") or 0))
        else:
            budget += int(s.get("kv_budget_bytes") or 0)
    caches = [s.get("prefix_cache") or {} for s in stats]
    return Totals(
        generated=sum(int(s.get("generation_tokens") or 0) for s in stats),
        hits=sum(int(c.get("hits") or 0) for c in caches),
        misses=sum(int(c.get("misses") or 0) for c in caches),
        running=sum(int(s.get("running") or 0) for s in stats),
        waiting=sum(int(s.get("waiting") or 0) for s in stats),
        kv_used_bytes=sum(int(s.get("cache_bytes") or 0) for s in stats),
        kv_budget_bytes=budget + pooled,
    )


@dataclass(frozen=True)
class Sample:
    t: float  # unix time
    tokens_per_s: float
    in_flight: int
    running: int
    waiting: int
    hit_ratio: float | None
    kv_used_bytes: int
    kv_budget_bytes: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q` quantile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class History:
    """One `Sample` a second for the last `HISTORY_S` seconds."""

    def __init__(
        self,
        board: StatusBoard,
        stats: Callable[[], list[dict[str, Any]]],
        seconds: int = HISTORY_S,
    ) -> None:
        self.board = board
        self._stats = stats
        self.samples: deque[Sample] = deque(maxlen=seconds)
        # (monotonic time, totals) of the last WINDOW_S seconds, for rates and windows.
        self._marks: deque[tuple[float, Totals]] = deque(maxlen=WINDOW_S + 1)

    def sample(self) -> Sample:
        now = time.monotonic()
        totals = engine_totals(self._stats())
        rate = 0.0
        if self._marks:
            then, last = self._marks[-1]
            if now > then:
                rate = max(0, totals.generated - last.generated) / (now - then)
        hit_ratio = None
        if self._marks:
            oldest = self._marks[0][1]
            lookups = (totals.hits - oldest.hits) + (totals.misses - oldest.misses)
            if lookups > 0:
                hit_ratio = (totals.hits - oldest.hits) / lookups
        self._marks.append((now, totals))
        ttfts = self.board.recent_ttfts(now, WINDOW_S)
        sample = Sample(
            t=round(time.time(), 3),
            tokens_per_s=round(rate, 3),
            in_flight=len(self.board.runs()),
            running=totals.running,
            waiting=totals.waiting,
            hit_ratio=None if hit_ratio is None else round(hit_ratio, 4),
            kv_used_bytes=totals.kv_used_bytes,
            kv_budget_bytes=totals.kv_budget_bytes,
            ttft_p50_s=_round(percentile(ttfts, 0.5)),
            ttft_p95_s=_round(percentile(ttfts, 0.95)),
        )
        self.samples.append(sample)
        return sample

    def since(self, t: float) -> list[dict[str, Any]]:
        """The samples taken after unix time `t`, oldest first."""
        return [asdict(s) for s in self.samples if s.t > t]

    def recent_rate(self, seconds: int = 5) -> float:
        """Generated tokens/s over the last few samples (one second alone is jumpy)."""
        recent = list(self.samples)[-seconds:]
        return round(sum(s.tokens_per_s for s in recent) / len(recent), 3) if recent else 0.0

    async def run(self, interval_s: float = INTERVAL_S) -> None:
        """Sample every `interval_s` until cancelled (a failed sample is logged, skipped)."""
        next_at = time.monotonic()
        while True:
            try:
                self.sample()
            except (KeyError, TypeError, ValueError, AttributeError):
                logger.exception("sampling the status history failed")
            next_at += interval_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
