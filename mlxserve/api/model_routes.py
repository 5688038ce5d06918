"""The routes about the served models: `/v1/models`, `/health`, `/v1/cache/stats`, `/metrics`."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api.errors import APIError, check_api_key
from mlxserve.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mlxserve.api.models import ServedModels
from mlxserve.api.process_memory import process_memory
from mlxserve.api.state import ServerState

# /health's status words, best first: several models answer with the worst.
_HEALTH_ORDER = ("ok", "loading", "error")


def model_health(state: ServerState) -> dict[str, Any]:
    """One model's /health body: ok, loading (with progress) or error (with the reason)."""
    engine = state.engine
    if engine.failure is not None:
        return {"status": "error", "error": f"the engine failed: {engine.failure}"}
    if engine.load_error is not None:
        return {"status": "error", "error": engine.load_error}
    if not engine.ready:
        body: dict[str, Any] = {"status": "loading"}
        progress = state.load_progress
        if progress is not None and progress.stage != "starting":
            body["progress"] = round(progress.fraction, 3)
            body["stage"] = progress.stage
        return body
    return {"status": "ok"}


def server_health(server: ServedModels) -> tuple[int, dict[str, Any]]:
    """The status code and body of /health: 200 only when every model is ready."""
    bodies = {state.model_name: model_health(state) for state in server.models}
    if len(bodies) == 1:
        body = next(iter(bodies.values()))
    else:
        worst = max((b["status"] for b in bodies.values()), key=_HEALTH_ORDER.index)
        body = {"status": worst, "models": bodies}
        errors = [f"{name}: {b['error']}" for name, b in bodies.items() if "error" in b]
        if errors:
            body["error"] = "; ".join(errors)
    return (200 if body["status"] == "ok" else 503), body


_MEMORY_KEYS = ("mlx_active_bytes", "mlx_cache_bytes", "mlx_peak_bytes", "live_requests")


def cache_stats(stats: dict[str, Any], process: dict[str, int]) -> dict[str, Any]:
    """One model's /v1/cache/stats figures, from its engine's stats; `memory` adds
    the process's figures, so growth shows beside what the model accounts for."""
    cache = dict(stats.get("prefix_cache") or {})
    cache["enabled"] = bool(stats.get("prefix_cache"))
    cache["disk"] = stats.get("prefix_cache_disk")
    memory = {key: stats.get(key, 0) for key in _MEMORY_KEYS}
    memory["prefix_cache_bytes"] = cache.get("bytes", 0)
    cache["memory"] = {**process, **memory}
    return cache


def model_stats(state: ServerState) -> dict[str, Any]:
    """The engine's figures, and the runs the api layer still holds."""
    return {**state.engine.stats(), "live_requests": len(state.live_runs)}


def process_figures(app: FastAPI) -> dict[str, int]:
    """The process's memory and the shared store of responses."""
    figures = process_memory()
    responses = getattr(app.state, "responses", None)
    if responses is not None:
        figures["responses_stored"] = len(responses.store)
        figures["responses_stored_bytes"] = responses.store.nbytes
    return figures


def add_model_routes(app: FastAPI, server: ServedModels) -> None:
    created = int(time.time())
    api_key = server.config.api_key

    def model_cards() -> dict[str, dict[str, Any]]:
        cards: dict[str, dict[str, Any]] = {}
        for state in server.models:
            limit = state.context_limit(state.engine.model) if state.engine.ready else None
            for name in state.served_names:
                card: dict[str, Any] = {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "mlxserve",
                    "root": state.model_name,
                }
                if limit is not None:
                    card["max_model_len"] = limit
                cards[name] = card
        return cards

    @app.get("/v1/models")
    async def _models(request: Request) -> dict[str, Any]:
        check_api_key(request, api_key)
        return {"object": "list", "data": list(model_cards().values())}

    # Served names may hold slashes (`org/model`), as hub ids do.
    @app.get("/v1/models/{model_id:path}")
    async def _model(request: Request, model_id: str) -> dict[str, Any]:
        check_api_key(request, api_key)
        card = model_cards().get(model_id)
        if card is None:
            message = f"The model '{model_id}' does not exist"
            raise APIError(404, message, param="model", code="model_not_found")
        return card

    @app.get("/health")
    async def _health() -> JSONResponse:
        status, body = server_health(server)
        return JSONResponse(body, status_code=status)

    @app.get("/v1/cache/stats")
    async def _cache_stats(request: Request) -> dict[str, Any]:
        """The default model's prefix-cache figures, and each model's under `models`."""
        check_api_key(request, api_key)
        stats = {s.model_name: model_stats(s) for s in server.models}
        process = process_figures(app)
        default = server.default.model_name
        body = cache_stats(stats[default], process)
        body["model"] = default
        body["models"] = {name: cache_stats(each, process) for name, each in stats.items()}
        pool = stats[default].get("kv_pool")
        if pool is not None:
            body["kv_pool"] = pool
        return body

    @app.get("/metrics")
    async def _metrics() -> Response:
        models = [(s.model_name, model_stats(s), s.engine.ready) for s in server.models]
        text = server.metrics.render(models, process_figures(app))
        return Response(text, media_type=METRICS_CONTENT_TYPE)
