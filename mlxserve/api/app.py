"""The FastAPI application: routes, auth, error handlers, engine lifecycle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api.anthropic.events import error_shape as anthropic_error_shape
from mlxserve.api.anthropic.routes import count_tokens, messages
from mlxserve.api.errors import (
    APIError,
    BodyLimitMiddleware,
    ErrorShapes,
    GenerationFailed,
    check_api_key,
    install_handlers,
)
from mlxserve.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mlxserve.api.openai.routes import chat_completions, completions
from mlxserve.api.responses.routes import ResponsesAPI
from mlxserve.api.responses.store import ResponseStore
from mlxserve.api.state import ServerState
from mlxserve.api.writer import ClientGone

logger = logging.getLogger(__name__)

Handler = Callable[[ServerState, Request], Awaitable[Response]]


def create_app(state: ServerState, start_engine: bool = True) -> FastAPI:
    """Build the app; its lifespan starts the engine (inside the running loop) and stops it."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks: list[asyncio.Task[None]] = []
        if start_engine:
            state.engine.start()
            tasks.append(asyncio.create_task(report_loading(state)))
            tasks.append(asyncio.create_task(watch_engine(state)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await state.engine.shutdown()

    app = FastAPI(title="mlxserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    # The Messages routes answer errors in Anthropic's shape, every other route in OpenAI's.
    shapes = ErrorShapes({"/v1/messages": anthropic_error_shape})
    install_handlers(app, shapes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.config.max_body_bytes, shapes=shapes)
    _add_routes(app, state)
    return app


async def report_loading(state: ServerState, every_s: float = 5.0) -> None:
    """Log load progress until the model is ready (or failed); /health says 503 meanwhile."""
    start = time.monotonic()
    logger.info("loading the model on the engine thread ...")
    next_report = every_s
    while not state.engine.ready and state.engine.load_error is None:
        await asyncio.sleep(0.1)
        elapsed = time.monotonic() - start
        if elapsed >= next_report:
            progress = state.load_progress
            if progress is None:
                logger.info("still loading the model (%.0f s)", elapsed)
            else:
                logger.info(
                    "still loading the model: %.0f%% (%s, %.0f s)",
                    progress.fraction * 100,
                    progress.stage,
                    elapsed,
                )
            next_report += every_s
    if state.engine.load_error is not None:
        logger.error("the model failed to load: %s", state.engine.load_error)
        if state.on_load_failure is not None:
            state.on_load_failure(state.engine.load_error)
    else:
        logger.info("model ready in %.1f s", time.monotonic() - start)


async def watch_engine(state: ServerState, every_s: float = 0.2) -> None:
    """Report the engine thread's death once (`/health` says 503 from then on)."""
    while state.engine.failure is None:
        await asyncio.sleep(every_s)
    logger.critical("the engine thread died: %s", state.engine.failure)
    if state.on_engine_failure is not None:
        state.on_engine_failure(state.engine.failure)


async def _generate(state: ServerState, request: Request, kind: str, handler: Handler) -> Response:
    check_api_key(request, state.config.api_key)
    try:
        # Anything that raises between submit and the response aborts the engine request.
        with state.owning_requests():
            return await handler(state, request)
    except GenerationFailed:
        raise
    except APIError as e:
        state.metrics.count_request(kind, str(e.status))
        raise
    except ClientGone:
        logger.info("client disconnected; request aborted")
        return Response(status_code=499)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    created = int(time.time())

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        return await _generate(state, request, "chat", chat_completions)

    @app.post("/v1/completions")
    async def _completions(request: Request) -> Response:
        return await _generate(state, request, "text", completions)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def _root() -> dict[str, str]:
        # Clients probe the base URL before their first request (Claude Code sends HEAD /).
        return {"name": "mlxserve", "model": state.model_name}

    @app.post("/v1/messages")
    async def _messages(request: Request) -> Response:
        return await _generate(state, request, "messages", messages)

    store = ResponseStore(state.config.responses_store, state.config.responses_store_bytes)
    responses = ResponsesAPI(store)
    app.state.responses = responses

    @app.post("/v1/responses")
    async def _responses(request: Request) -> Response:
        return await _generate(state, request, "responses", responses.create)

    @app.get("/v1/responses/{response_id}")
    async def _get_response(request: Request, response_id: str) -> Response:
        check_api_key(request, state.config.api_key)
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def _delete_response(request: Request, response_id: str) -> Response:
        check_api_key(request, state.config.api_key)
        return responses.delete(response_id)

    @app.post("/v1/messages/count_tokens")
    async def _count_tokens(request: Request) -> Response:
        check_api_key(request, state.config.api_key)
        return await count_tokens(state, request)

    def model_cards() -> dict[str, dict[str, Any]]:
        limit = state.context_limit(state.engine.model) if state.engine.ready else None
        cards: dict[str, dict[str, Any]] = {}
        for name in state.served_names:
            card: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "mlxserve",
            }
            if limit is not None:
                card["max_model_len"] = limit
            cards[name] = card
        return cards

    @app.get("/v1/models")
    async def _models(request: Request) -> dict[str, Any]:
        check_api_key(request, state.config.api_key)
        return {"object": "list", "data": list(model_cards().values())}

    # Served names may hold slashes (`org/model`), as hub ids do.
    @app.get("/v1/models/{model_id:path}")
    async def _model(request: Request, model_id: str) -> dict[str, Any]:
        check_api_key(request, state.config.api_key)
        card = model_cards().get(model_id)
        if card is None:
            message = f"The model '{model_id}' does not exist"
            raise APIError(404, message, param="model", code="model_not_found")
        return card

    @app.get("/health")
    async def _health() -> JSONResponse:
        failure = state.engine.failure
        if failure is not None:
            failed = {"status": "error", "error": f"the engine failed: {failure}"}
            return JSONResponse(failed, status_code=503)
        error = state.engine.load_error
        if error is not None:
            return JSONResponse({"status": "error", "error": error}, status_code=503)
        if not state.engine.ready:
            body: dict[str, Any] = {"status": "loading"}
            if state.load_progress is not None and state.load_progress.stage != "starting":
                body["progress"] = round(state.load_progress.fraction, 3)
                body["stage"] = state.load_progress.stage
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/cache/stats")
    async def _cache_stats(request: Request) -> dict[str, Any]:
        check_api_key(request, state.config.api_key)
        stats = state.engine.stats()
        cache = dict(stats.get("prefix_cache") or {})
        cache["enabled"] = bool(stats.get("prefix_cache"))
        cache["disk"] = stats.get("prefix_cache_disk")
        return cache

    @app.get("/metrics")
    async def _metrics() -> Response:
        text = state.metrics.render(state.engine.stats(), state.engine.ready)
        return Response(text, media_type=METRICS_CONTENT_TYPE)
