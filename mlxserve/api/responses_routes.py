"""The OpenAI Responses endpoints: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`.

A thin edge over the shared chat path: `responses_convert` turns the body
(and the stored conversation `previous_response_id` names) into the
internal `ChatGeneration`, `start_chat` renders and submits it (same
encoder, engine, parsers and prefix cache as chat completions), and
`responses_events` writes the pipeline's deltas as Responses events.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api.anthropic_events import sse_event
from mlxserve.api.errors import APIError
from mlxserve.api.handlers import GenerationRun, accept, start_chat
from mlxserve.api.keepalive import SSE_COMMENT, with_keepalive
from mlxserve.api.pipeline import EngineRequestFailed
from mlxserve.api.responses_convert import ResponsesTurn, echo_settings, to_turn
from mlxserve.api.responses_events import (
    Event,
    ResponseEvents,
    ResponseShell,
    response_body,
)
from mlxserve.api.responses_protocol import ResponsesRequest
from mlxserve.api.responses_store import ResponseStore
from mlxserve.api.state import ServerState
from mlxserve.api.stream import ResponseMeta
from mlxserve.models.loaded import LoadedModel

Keep = Callable[[Mapping[str, Any]], None]
# The shared checks name chat-completions fields; a Responses client wrote these.
# Rendering names the chat messages the input became; the client sent `input`.
_PARAMS = {"messages": "input"}


def _frame(event: Event) -> bytes:
    return sse_event((str(event["type"]), event))


async def event_stream(
    run: GenerationRun,
    writer: ResponseEvents,
    keepalive_s: float,
    keep: Keep,
    count: Callable[[str], int],
) -> AsyncIterator[bytes]:
    usage = run.pipeline.usage
    for event in writer.start():
        yield _frame(event)
    try:
        async for delta in with_keepalive(run.deltas(), keepalive_s):
            if delta is None:
                yield SSE_COMMENT
                continue
            for event in writer.delta(delta):
                yield _frame(event)
            if delta.finish_reason is not None:
                tokens = count(writer.reasoning_text)
                for event in writer.finish(delta.finish_reason, usage, tokens):
                    yield _frame(event)
    except EngineRequestFailed as e:
        for event in writer.fail(f"generation failed: {e}", usage):
            yield _frame(event)
        return
    if writer.final is not None:
        keep(writer.final)


async def _body(
    run: GenerationRun, shell: ResponseShell, keep: Keep, count: Callable[[str], int]
) -> dict[str, Any]:
    acc = await run.accumulate()
    body = response_body(shell, acc, run.pipeline.usage, count)
    keep(body)
    return body


async def _start(
    state: ServerState, model: LoadedModel, turn: ResponsesTurn, meta: ResponseMeta, arrival: float
) -> GenerationRun:
    try:
        _, run = await start_chat(state, model, turn.generation, meta, arrival)
    except APIError as e:
        param = _PARAMS.get(e.param or "")
        if param is None or e.param is None:
            raise
        message = e.message.replace(e.param, param)
        raise APIError(e.status, message, type=e.type, param=param, code=e.code) from e
    return run


def _token_counter(model: LoadedModel) -> Callable[[str], int]:
    def count(text: str) -> int:
        if not text:
            return 0
        return len(model.tokenizer.encode(text, add_special_tokens=False))

    return count


class ResponsesAPI:
    """The Responses routes over one store of responses."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def create(self, state: ServerState, request: Request) -> Response:
        arrival = time.monotonic()
        req, model = await accept(state, request, ResponsesRequest)
        history: tuple[Mapping[str, Any], ...] = ()
        if req.previous_response_id is not None:
            history = self.store.previous(req.previous_response_id).items
        turn = to_turn(req, history)
        meta = ResponseMeta(
            id=f"resp_{uuid.uuid4().hex}",
            model=state.model_name,
            created=int(time.time()),
            kind="responses",
        )
        run = await _start(state, model, turn, meta, arrival)
        shell = ResponseShell(
            meta.id,
            meta.model,
            meta.created,
            echo_settings(req),
            include_encrypted=req.include_encrypted,
            namespaces=turn.namespaces,
        )

        def keep(body: Mapping[str, Any]) -> None:
            if req.stores and body.get("status") in ("completed", "incomplete"):
                self.store.put(body, (*turn.items, *body["output"]))

        count = _token_counter(model)
        if turn.generation.stream:
            writer = ResponseEvents(shell)
            keepalive_s = state.config.keepalive_interval_s
            return run.stream_response(event_stream(run, writer, keepalive_s, keep, count))
        return await run.json_response(request, _body(run, shell, keep, count))

    def retrieve(self, response_id: str) -> JSONResponse:
        return JSONResponse(dict(self.store.get(response_id).body))

    def delete(self, response_id: str) -> JSONResponse:
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
