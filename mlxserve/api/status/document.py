"""The `/v1/status` document: one JSON object an operator's page (or any tool) reads.

Its top-level keys are a contract: `models`, `engine`, `requests`, `memory`,
`prefix_cache`, `speculation`, `errors` (and `health`, `uptime_s`, `time`;
`history` when asked for). Everything comes from what the server already
keeps: each engine's `stats()` and per-request `progress()` (attributes the
engine thread updates; nothing waits on it), the status board (runs in
flight, recent errors) and the sampled history. No prompt or output text.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from mlxserve.api.model_routes import model_health
from mlxserve.api.models import ServedModels
from mlxserve.api.state import ServerState
from mlxserve.api.status.board import RunRecord, StatusBoard
from mlxserve.api.status.history import History
from mlxserve.engine.request import RequestStatus

Stats = dict[str, dict[str, Any]]
_STATES = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.PREFILLING: "prefilling",
    RequestStatus.RUNNING: "decoding",
}
_COUNTERS = (
    "finished",
    "aborted",
    "errors",
    "preemptions",
    "timeouts",
    "prompt_tokens",
    "prefilled_tokens",
    "generation_tokens",
)


def status_document(
    server: ServedModels, board: StatusBoard, history: History, since: float | None = None
) -> dict[str, Any]:
    """The whole document; `since` (unix time) adds the history samples taken after it."""
    stats: Stats = {s.model_name: dict(s.engine.stats() or {}) for s in server.models}
    models = [model_card(s, stats[s.model_name], s is server.default) for s in server.models]
    doc: dict[str, Any] = {
        "object": "status",
        "time": round(time.time(), 3),
        "uptime_s": round(board.uptime_s, 3),
        "health": _health(models),
        "models": models,
        "engine": engine_section(stats, history.recent_rate()),
        "requests": [request_entry(server, r) for r in board.runs()],
        "memory": memory_section(stats),
        "prefix_cache": prefix_cache_section(stats),
        "speculation": speculation_section(stats),
        "errors": [
            {"time": e.time, "route": e.route, "status": e.status, "message": e.message}
            | ({"model": e.model} if e.model else {})
            for e in reversed(board.errors())
        ],
        "errors_total": board.errors_total,
    }
    if since is not None:
        doc["history"] = {
            "interval_s": 1,
            "window_s": 60,
            "samples": history.since(since),
        }
    return doc


def model_card(state: ServerState, stats: dict[str, Any], default: bool) -> dict[str, Any]:
    """One model: its names, family, quantization, weight bytes and state."""
    health = model_health(state)
    card: dict[str, Any] = {
        "name": state.model_name,
        "aliases": [n for n in state.served_names if n != state.model_name],
        "default": default,
        "state": "stalled" if stats.get("stalled") else health["status"],
        "family": None,
        "quantization": None,
        "weight_bytes": int(stats.get("weight_bytes") or 0),
        "context_limit": None,
    }
    for key in ("progress", "stage", "error"):
        if key in health:
            card[key] = health[key]
    if state.engine.ready:
        model = state.engine.model
        card["family"] = model.model_type
        card["quantization"] = quantization(model.config)
        card["context_limit"] = state.context_limit(model)
    return card


def quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """`{"bits", "group_size", "mode"}` of a quantized checkpoint's config, else None."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    out = {key: q[key] for key in ("bits", "group_size", "mode", "quant_method") if key in q}
    return out or None


def _health(models: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst model state: stalled, then error, then loading, else ok."""
    for word in ("stalled", "error", "loading"):
        bad = [m for m in models if m["state"] == word]
        if bad:
            body: dict[str, Any] = {"status": word}
            reasons = [f"{m['name']}: {m['error']}" for m in bad if m.get("error")]
            if reasons:
                body["error"] = "; ".join(reasons)
            if word == "loading" and "progress" in bad[0]:
                body["progress"] = bad[0]["progress"]
            return body
    return {"status": "ok"}


def _engine_entry(s: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "alive": bool(s.get("alive", False)),
        "ready": bool(s.get("ready", False)),
        "stalled": bool(s.get("stalled", False)),
        "failure": s.get("failure"),
        "step_ms": round(float(s.get("step_s") or 0.0) * 1000, 3),
        "last_step_ms": round(float(s.get("last_step_s") or 0.0) * 1000, 3),
        "queue_length": int(s.get("waiting") or 0),
        "batch_size": int(s.get("running") or 0),
        "steps": int(s.get("steps") or 0),
    }
    for key in _COUNTERS:
        entry[key] = int(s.get(key) or 0)
    return entry


def engine_section(stats: Stats, tokens_per_s: float) -> dict[str, Any]:
    """Every engine together (alive: all of them; step time: the slowest), and each one."""
    each = {name: _engine_entry(s) for name, s in stats.items()}
    entries = list(each.values())
    section: dict[str, Any] = {
        "alive": all(e["alive"] for e in entries),
        "stalled": any(e["stalled"] for e in entries),
        "step_ms": max(e["step_ms"] for e in entries),
        "last_step_ms": max(e["last_step_ms"] for e in entries),
        "queue_length": sum(e["queue_length"] for e in entries),
        "batch_size": sum(e["batch_size"] for e in entries),
        "steps": sum(e["steps"] for e in entries),
        "tokens_per_s": tokens_per_s,
    }
    for key in _COUNTERS:
        section[key] = sum(e[key] for e in entries)
    section["models"] = each
    return section


def request_entry(server: ServedModels, record: RunRecord) -> dict[str, Any]:
    """One run in flight: where the engine has it, and what its client has received."""
    progress = None
    state = _state_of(server, record.model)
    if state is not None:
        progress = state.engine.progress(record.id)
    if progress is not None and progress.status in _STATES:
        phase = _STATES[progress.status]
    else:
        phase = "decoding" if record.generated_tokens else "waiting"
    cached = max(record.cached_tokens, progress.cached if progress else 0)
    entry: dict[str, Any] = {
        "id": record.id,
        "model": record.model,
        "route": record.route,
        "dialect": record.dialect,
        "user_agent": record.user_agent,
        "state": phase,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": cached,
        "generated_tokens": record.generated_tokens,
        "ttft_s": _round(record.ttft_s),
        "tokens_per_s": _round(record.tokens_per_s),
        "age_s": round(time.monotonic() - record.arrival, 3),
        "started_at": round(record.started_at, 3),
        "prefill": None,
    }
    if progress is not None and phase != "decoding":
        entry["prefill"] = {
            "done": progress.computed,
            "total": progress.fill,
            "fraction": round(progress.computed / progress.fill, 4) if progress.fill else 0.0,
        }
    return entry


def _state_of(server: ServedModels, name: str) -> ServerState | None:
    return next((s for s in server.models if s.model_name == name), None)


def memory_section(stats: Stats) -> dict[str, Any]:
    """The KV byte budget and what the caches hold of it, together and per model."""
    each: dict[str, dict[str, Any]] = {}
    for name, s in stats.items():
        each[name] = {
            "kv_budget_bytes": int(s.get("kv_budget_bytes") or 0),
            "kv_used_bytes": int(s.get("cache_bytes") or 0),
            "kv_requests_bytes": int(s.get("kv_cache_bytes") or 0),
            "peak_used_bytes": int(s.get("peak_cache_bytes") or 0),
            "prefix_cache_bytes": int((s.get("prefix_cache") or {}).get("bytes") or 0),
            "weight_bytes": int(s.get("weight_bytes") or 0),
        }
    pools = [s["kv_pool"] for s in stats.values() if s.get("kv_pool")]
    budget = (
        int(pools[0].get("budget_bytes") or 0)
        if pools
        else sum(e["kv_budget_bytes"] for e in each.values())
    )
    used = sum(e["kv_used_bytes"] for e in each.values())
    section: dict[str, Any] = {
        "kv_budget_bytes": budget,
        "kv_used_bytes": used,
        "kv_used_ratio": round(used / budget, 4) if budget else None,
        "shared_pool": bool(pools),
    }
    for key in ("kv_requests_bytes", "peak_used_bytes", "prefix_cache_bytes", "weight_bytes"):
        section[key] = sum(e[key] for e in each.values())
    # MLX's allocator is one per process: every engine reports the same figures.
    for key in ("mlx_active_bytes", "mlx_cache_bytes"):
        section[key] = max((int(s.get(key) or 0) for s in stats.values()), default=0)
    section["models"] = each
    return section


def _ratio(hits: int, misses: int) -> float | None:
    return round(hits / (hits + misses), 4) if hits + misses else None


def _cache_entry(cache: dict[str, Any] | None, disk: dict[str, Any] | None) -> dict[str, Any]:
    c = cache or {}
    entry: dict[str, Any] = {"enabled": cache is not None}
    for key in ("entries", "bytes", "hits", "misses", "tokens_reused", "evictions"):
        entry[key] = int(c.get(key) or 0)
    entry["hit_ratio"] = _ratio(entry["hits"], entry["misses"])
    entry["disk"] = None
    if disk is not None:
        d = {key: disk.get(key, 0) for key in _DISK_KEYS}
        d["hit_ratio"] = _ratio(int(d["hits"]), int(d["misses"]))
        entry["disk"] = d
    return entry


_DISK_KEYS = ("entries", "bytes", "max_bytes", "hits", "misses", "writes", "dropped_writes")


def prefix_cache_section(stats: Stats) -> dict[str, Any]:
    """RAM and disk: entries, bytes, hit ratio; together and per model."""
    each = {
        name: _cache_entry(s.get("prefix_cache"), s.get("prefix_cache_disk"))
        for name, s in stats.items()
    }
    section = _sum_entries(each.values(), ("entries", "bytes", "hits", "misses", "tokens_reused"))
    section["enabled"] = any(e["enabled"] for e in each.values())
    section["hit_ratio"] = _ratio(section["hits"], section["misses"])
    disks = [e["disk"] for e in each.values() if e["disk"] is not None]
    section["disk"] = None
    if disks:
        disk = _sum_entries(disks, _DISK_KEYS)
        disk["hit_ratio"] = _ratio(disk["hits"], disk["misses"])
        section["disk"] = disk
    section["evictions"] = sum(e["evictions"] for e in each.values())
    section["models"] = each
    return section


def _sum_entries(entries: Iterable[dict[str, Any]], keys: Iterable[str]) -> dict[str, Any]:
    listed = list(entries)
    return {key: sum(int(e.get(key) or 0) for e in listed) for key in keys}


def speculation_section(stats: Stats) -> dict[str, Any]:
    """Draft tokens proposed and accepted (None per model where speculation is off)."""
    each: dict[str, dict[str, Any] | None] = {}
    for name, s in stats.items():
        spec = s.get("speculative")
        each[name] = None
        if spec:
            drafted = int(spec.get("draft_tokens") or 0)
            accepted = int(spec.get("accepted_tokens") or 0)
            each[name] = {
                "drafter": spec.get("drafter"),
                "draft_tokens": drafted,
                "accepted_tokens": accepted,
                "acceptance": round(accepted / drafted, 4) if drafted else None,
                "tokens_per_forward": round(float(spec.get("tokens_per_forward") or 0.0), 4),
            }
    on = [e for e in each.values() if e is not None]
    drafted = sum(e["draft_tokens"] for e in on)
    accepted = sum(e["accepted_tokens"] for e in on)
    return {
        "enabled": bool(on),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": round(accepted / drafted, 4) if drafted else None,
        "models": each,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
