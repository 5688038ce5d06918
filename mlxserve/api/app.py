"""The FastAPI application: routes, auth, error handlers, engine lifecycle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response

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
from mlxserve.api.model_routes import add_model_routes
from mlxserve.api.models import ROUTED, ServedModels
from mlxserve.api.openai.routes import chat_completions, completions
from mlxserve.api.responses.routes import ResponsesAPI
from mlxserve.api.responses.store import ResponseStore
from mlxserve.api.state import ServerState, owning_requests
from mlxserve.api.status.board import CURRENT_CALL, CallInfo, StatusBoard
from mlxserve.api.status.history import History
from mlxserve.api.status.routes import DASHBOARD_PATH, QUIET_PATHS, add_status_routes, wants_page
from mlxserve.api.writer import ClientGone

logger = logging.getLogger(__name__)

Handler = Callable[[ServedModels, Request], Awaitable[Response]]


def create_app(served: ServedModels | ServerState, start_engine: bool = True) -> FastAPI:
    """Build the app; its lifespan starts the engines (inside the running loop) and stops them."""
    server = served if isinstance(served, ServedModels) else ServedModels.one(served)
    history = History(server.board, lambda: [s.engine.stats() for s in server.models])

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks: list[asyncio.Task[None]] = [asyncio.create_task(history.run())]
        if start_engine:
            for state in server.models:
                state.engine.start()
                tasks.append(asyncio.create_task(report_loading(state)))
                tasks.append(asyncio.create_task(watch_engine(state)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*(state.engine.shutdown() for state in server.models))

    app = FastAPI(title="mlxserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    # The Messages routes answer errors in Anthropic's shape, every other route in OpenAI's.
    shapes = ErrorShapes({"/v1/messages": anthropic_error_shape}, _error_log(server.board))
    install_handlers(app, shapes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server.config.max_body_bytes, shapes=shapes)
    _add_routes(app, server)
    add_model_routes(app, server)
    add_status_routes(app, server, server.board, history, server.config.dashboard)
    return app


def _error_log(board: StatusBoard) -> Callable[[APIError, str], None]:
    """Every error answered, for the status page (not the page's own: a poll without its key)."""

    def record(error: APIError, path: str) -> None:
        if not path.startswith(QUIET_PATHS):
            board.error(path, error.status, error.message)

    return record


async def report_loading(state: ServerState, every_s: float = 5.0) -> None:
    """Log load progress until the model is ready (or failed); /health says 503 meanwhile."""
    start = time.monotonic()
    logger.info("loading the model %r on its engine thread ...", state.model_name)
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


async def _generate(
    server: ServedModels, request: Request, kind: str, handler: Handler
) -> Response:
    check_api_key(request, server.config.api_key)
    routed = ROUTED.set(None)
    agent = request.headers.get("user-agent", "")
    call = CURRENT_CALL.set(CallInfo(server.board, request.url.path, kind, agent))
    try:
        # Anything that raises between submit and the response aborts the engine request.
        with owning_requests():
            return await handler(server, request)
    except GenerationFailed:
        raise
    except APIError as e:
        (ROUTED.get() or server.default).metrics.count_request(kind, str(e.status))
        raise
    except ClientGone:
        logger.info("client disconnected; request aborted")
        return Response(status_code=499)
    finally:
        ROUTED.reset(routed)
        CURRENT_CALL.reset(call)


def _add_routes(app: FastAPI, server: ServedModels) -> None:
    config = server.config

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        return await _generate(server, request, "chat", chat_completions)

    @app.post("/v1/completions")
    async def _completions(request: Request) -> Response:
        return await _generate(server, request, "text", completions)

    @app.api_route("/", methods=["GET", "HEAD"], response_model=None)
    async def _root(request: Request) -> dict[str, str] | Response:
        # Clients probe the base URL before their first request (Claude Code sends HEAD /)
        # and get this JSON; a browser (asking for HTML) is sent to the operator page.
        if config.dashboard and request.method == "GET" and wants_page(request):
            return RedirectResponse(DASHBOARD_PATH, status_code=307)
        return {"name": "mlxserve", "model": server.default.model_name}

    @app.post("/v1/messages")
    async def _messages(request: Request) -> Response:
        return await _generate(server, request, "messages", messages)

    store = ResponseStore(config.responses_store, config.responses_store_bytes)
    responses = ResponsesAPI(store)
    app.state.responses = responses

    @app.post("/v1/responses")
    async def _responses(request: Request) -> Response:
        return await _generate(server, request, "responses", responses.create)

    @app.get("/v1/responses/{response_id}")
    async def _get_response(request: Request, response_id: str) -> Response:
        check_api_key(request, config.api_key)
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def _delete_response(request: Request, response_id: str) -> Response:
        check_api_key(request, config.api_key)
        return responses.delete(response_id)

    @app.post("/v1/messages/count_tokens")
    async def _count_tokens(request: Request) -> Response:
        check_api_key(request, config.api_key)
        return await count_tokens(server, request)
