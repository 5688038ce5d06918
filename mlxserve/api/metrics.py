"""Prometheus metrics of one server, through the `prometheus_client` library.

Each `Metrics` owns its own `CollectorRegistry` (never the process-global
one), so several servers in one process (tests) do not collide. Counters and
latency histograms are updated by the request handlers on the event loop;
gauges and engine totals (running/waiting, prefix cache, KV bytes) are read
from `engine.stats()` at scrape time by a collector of this registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

PREFIX = "mlxserve"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# `*_created` series double every counter's lines and nobody here reads them.
disable_created_metrics()


# Every series carries the model it describes (a server may serve several).
MODEL_LABEL = "model_name"
Family = GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily
ModelStats = tuple[str, dict[str, Any], bool]


class _EngineCollector(Collector):
    """Gauges and engine-side counters from each model's latest `engine.stats()`."""

    def __init__(self) -> None:
        self.models: list[ModelStats] = []
        self.server: dict[str, int] = {}

    def collect(self) -> Iterator[Family]:
        yield from _server_families(self.server)
        families: dict[str, Family] = {}
        for name, stats, ready in self.models:
            for family in _model_families(stats, ready):
                kept = families.setdefault(family.name, _labelled(family))
                for sample in family.samples:
                    labels = {**sample.labels, MODEL_LABEL: name}
                    kept.add_sample(sample.name, labels, sample.value)
        yield from families.values()


def _labelled(family: Family) -> Family:
    """An empty family like `family` (its samples get the model label as they are added)."""
    if isinstance(family, SummaryMetricFamily):
        return SummaryMetricFamily(family.name, family.documentation, labels=())
    kind = GaugeMetricFamily if isinstance(family, GaugeMetricFamily) else CounterMetricFamily
    return kind(family.name, family.documentation, labels=())


_SERVER_GAUGES = {
    "process_resident_bytes": "Resident memory of the server process now.",
    "process_peak_resident_bytes": "Largest resident memory of the server process so far.",
    "responses_stored": "Responses kept for previous_response_id and GET /v1/responses.",
    "responses_stored_bytes": "Bytes of the stored responses (their JSON).",
}


def _server_families(figures: dict[str, int]) -> Iterator[Family]:
    """Figures of the whole process, not of one model (so without the model label)."""
    for key, text in _SERVER_GAUGES.items():
        if key in figures:
            yield _gauge(f"{PREFIX}_{key}", text, figures[key])


def _model_families(stats: dict[str, Any], ready: bool) -> Iterator[Family]:
    p = PREFIX
    cache = stats.get("prefix_cache") or {}
    yield _gauge(f"{p}_model_ready", "1 once the model is loaded.", int(ready))
    alive = int(bool(stats.get("alive", True)))
    yield _gauge(f"{p}_engine_alive", "0 once the engine thread has died.", alive)
    stalled = int(bool(stats.get("stalled", False)))
    yield _gauge(f"{p}_engine_stalled", "1 once a step outlived --step-timeout.", stalled)
    yield _gauge(f"{p}_requests_running", "Requests decoding now.", _num(stats, "running"))
    yield _gauge(f"{p}_requests_waiting", "Requests queued for a slot.", _num(stats, "waiting"))
    yield _gauge(
        f"{p}_kv_cache_bytes",
        "Bytes of KV cache held by the requests in flight.",
        _num(stats, "kv_cache_bytes"),
    )
    yield _gauge(
        f"{p}_mlx_active_bytes", "Bytes of MLX arrays alive.", _num(stats, "mlx_active_bytes")
    )
    yield _gauge(
        f"{p}_mlx_cache_bytes",
        "Bytes of freed buffers MLX keeps for reuse.",
        _num(stats, "mlx_cache_bytes"),
    )
    yield _gauge(
        f"{p}_mlx_peak_bytes",
        "Largest bytes of MLX arrays alive at once so far.",
        _num(stats, "mlx_peak_bytes"),
    )
    yield _gauge(
        f"{p}_requests_live",
        "Requests the server still holds (in flight; a leak shows here as growth at rest).",
        _num(stats, "live_requests"),
    )
    for key in ("hits", "misses", "tokens_reused"):
        yield CounterMetricFamily(
            f"{p}_prefix_cache_{key}",
            f"Prefix cache {key.replace('_', ' ')}.",
            value=_num(cache, key),
        )
    for key in ("bytes", "entries"):
        yield _gauge(f"{p}_prefix_cache_{key}", f"Prefix cache {key}.", _num(cache, key))
    hits, misses = _num(cache, "hits"), _num(cache, "misses")
    ratio = hits / (hits + misses) if hits + misses else 0.0
    yield _gauge(
        f"{p}_prefix_cache_hit_ratio",
        "Share of prefix-cache lookups that reused a cached prefix (since start).",
        ratio,
    )
    yield from _disk_metrics(stats.get("prefix_cache_disk") or {})
    yield from _speculative_metrics(stats.get("speculative") or {})
    vision = stats.get("vision") or {}
    yield SummaryMetricFamily(
        f"{p}_vision_seconds",
        "Seconds in the vision tower (count: images it encoded; a prefix-cache hit "
        "that covers an image skips it).",
        count_value=int(_num(vision, "images")),
        sum_value=_num(vision, "seconds"),
    )


def _speculative_metrics(spec: dict[str, Any]) -> Iterator[Family]:
    if not spec:
        return
    p, labels = f"{PREFIX}_spec", ["drafter"]
    drafter = [str(spec.get("drafter", ""))]
    counters = {
        "draft_tokens": "Draft tokens verified.",
        "accepted_tokens": "Draft tokens accepted.",
        "verify_forwards": "Rows verified (a batch of B rows verifying counts B).",
    }
    for key, text in counters.items():
        family = CounterMetricFamily(f"{p}_{key}", text, labels=labels)
        family.add_metric(drafter, _num(spec, key))
        yield family
    per_forward = GaugeMetricFamily(
        f"{p}_tokens_per_forward",
        "Tokens a row's verify forward produced (accepted drafts + 1), since start.",
        labels=labels,
    )
    per_forward.add_metric(drafter, _num(spec, "tokens_per_forward"))
    yield per_forward


_DISK_COUNTERS = {
    "hits": "Prefix-cache entries restored from disk.",
    "misses": "Disk lookups that restored nothing (not found, unusable or no room).",
    "restored_tokens": "Prompt tokens restored from disk.",
    "restore_s": "Seconds spent restoring entries from disk (read, check, arrays).",
    "writes": "Entries written to disk.",
    "written_bytes": "Bytes written to disk.",
    "dropped_writes": "Writes dropped (disk full or failing, or the writer's backlog full).",
    "rejected_files": "Entry files removed as truncated, corrupt or another model's.",
    "evictions": "Disk entries removed to fit the disk byte budget.",
}
_DISK_GAUGES = {
    "entries": "Prefix-cache entries on disk.",
    "bytes": "Bytes of prefix-cache entries on disk.",
    "write_backlog": "Entries waiting for the disk writer.",
    "write_backlog_bytes": "Snapshot bytes waiting for the disk writer.",
    "last_restore_s": "Seconds the latest restore from disk took.",
}


def _disk_metrics(disk: dict[str, Any]) -> Iterator[Family]:
    if not disk:
        return
    p = f"{PREFIX}_prefix_cache_disk"
    for key, text in _DISK_COUNTERS.items():
        yield CounterMetricFamily(f"{p}_{key}", text, value=_num(disk, key))
    for key, text in _DISK_GAUGES.items():
        yield _gauge(f"{p}_{key}", text, _num(disk, key))


class Metrics:
    """Request counters and latency histograms of one server, labelled by model."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        p, reg, model = PREFIX, self.registry, [MODEL_LABEL]
        self._engine = _EngineCollector()
        reg.register(self._engine)
        self.requests = Counter(
            f"{p}_requests",
            "HTTP generation requests by endpoint and outcome.",
            ["endpoint", "outcome", MODEL_LABEL],
            registry=reg,
        )
        self.prompt = Counter(f"{p}_prompt_tokens", "Prompt tokens served.", model, registry=reg)
        self.generated = Counter(f"{p}_generation_tokens", "Tokens generated.", model, registry=reg)
        self.cached = Counter(
            f"{p}_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            model,
            registry=reg,
        )
        self.images = Counter(
            f"{p}_images",
            "Images received in generation requests, by what became of each: accepted (a "
            "model that reads images), placeholder (a note in its place), refused (a "
            "text-only model), invalid (a bad image), over_limit (its request held too "
            "many), skipped (its request failed on another image).",
            ["outcome", MODEL_LABEL],
            registry=reg,
        )
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Time to first token.",
            model,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            model,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            f"{p}_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            model,
            buckets=E2E_BUCKETS,
            registry=reg,
        )

    def for_model(self, name: str) -> ModelMetrics:
        return ModelMetrics(self, name)

    def render(self, models: list[ModelStats], server: dict[str, int] | None = None) -> str:
        """The text exposition (format 0.0.4) with each model's (name, engine stats, ready)
        and the process's own figures (`server`: memory, stored responses)."""
        self._engine.models = [(name, dict(stats or {}), ready) for name, stats, ready in models]
        self._engine.server = dict(server or {})
        return generate_latest(self.registry).decode("utf-8")


class ModelMetrics:
    """What the request handlers record for one served model."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        self.metrics = metrics
        self.name = name

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.metrics.requests.labels(endpoint, outcome, self.name).inc()

    def count_images(self, outcome: str, n: int = 1) -> None:
        if n:
            self.metrics.images.labels(outcome, self.name).inc(n)

    def observe_ttft(self, seconds: float) -> None:
        self.metrics.ttft.labels(self.name).observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.metrics.itl.labels(self.name).observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.metrics.e2e.labels(self.name).observe(seconds)

    def count_tokens(self, prompt: int, generated: int, cached: int) -> None:
        self.metrics.prompt.labels(self.name).inc(prompt)
        self.metrics.generated.labels(self.name).inc(generated)
        self.metrics.cached.labels(self.name).inc(cached)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _num(stats: dict[str, Any], key: str) -> int | float:
    value = stats.get(key, 0)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0
