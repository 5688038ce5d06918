"""Prometheus text exposition (format 0.0.4) of the server's counters.

Counters and the TTFT histogram live here (updated by the request handlers
on the event loop); gauges (running/waiting) and engine totals come from
`engine.stats()` at scrape time.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "mlxserve"


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out: list[str] = []
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {cumulative}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.total:.6f}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    """Request counters and latency histograms of one server."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] += 1

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def count_tokens(self, prompt: int, generated: int, cached: int) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generated
        self.cached_tokens += cached

    def render(self, engine_stats: dict[str, Any] | None, ready: bool) -> str:
        p = PREFIX
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, values: list[str]) -> None:
            lines.append(f"# HELP {p}_{name} {help_text}")
            lines.append(f"# TYPE {p}_{name} {kind}")
            lines.extend(f"{p}_{name}{v}" for v in values)

        stats = engine_stats or {}
        cache = stats.get("prefix_cache") or {}
        metric("model_ready", "gauge", "1 once the model is loaded.", [f" {int(ready)}"])
        alive = int(bool(stats.get("alive", True)))
        metric("engine_alive", "gauge", "0 once the engine thread has died.", [f" {alive}"])
        metric(
            "requests_running", "gauge", "Requests decoding now.", [f" {_num(stats, 'running')}"]
        )
        metric(
            "requests_waiting",
            "gauge",
            "Requests queued for a slot.",
            [f" {_num(stats, 'waiting')}"],
        )
        metric(
            "requests_total",
            "counter",
            "HTTP generation requests by endpoint and outcome.",
            [
                f'{{endpoint="{ep}",outcome="{oc}"}} {n}'
                for (ep, oc), n in sorted(self.requests.items())
            ],
        )
        metric(
            "prompt_tokens_total", "counter", "Prompt tokens served.", [f" {self.prompt_tokens}"]
        )
        metric(
            "generation_tokens_total",
            "counter",
            "Tokens generated.",
            [f" {self.generation_tokens}"],
        )
        metric(
            "cached_prompt_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            [f" {self.cached_tokens}"],
        )
        for key in ("hits", "misses", "tokens_reused", "bytes", "entries"):
            kind = "gauge" if key in ("bytes", "entries") else "counter"
            name = f"prefix_cache_{key}" + ("_total" if kind == "counter" else "")
            metric(name, kind, f"Prefix cache {key.replace('_', ' ')}.", [f" {_num(cache, key)}"])
        lines.append(f"# HELP {p}_time_to_first_token_seconds Time to first token.")
        lines.append(f"# TYPE {p}_time_to_first_token_seconds histogram")
        lines.extend(self.ttft.lines(f"{p}_time_to_first_token_seconds"))
        return "\n".join(lines) + "\n"


def _num(stats: dict[str, Any], key: str) -> int | float:
    value = stats.get(key, 0)
    return value if isinstance(value, int | float) else 0
