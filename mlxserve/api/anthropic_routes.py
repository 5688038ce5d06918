"""The Anthropic Messages endpoints: `/v1/messages` and `/v1/messages/count_tokens`.

A thin edge over the shared chat path: `anthropic_convert` turns the body
into the internal `ChatGeneration`, `start_chat` renders and submits it
(same encoder, engine, parsers and prefix cache as chat completions), and
`anthropic_events` writes the pipeline's deltas as Anthropic events.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api.anthropic_convert import prompt_request, show_thinking, to_generation
from mlxserve.api.anthropic_events import (
    PING,
    MessageEvents,
    MessageMeta,
    error_event,
    message_body,
    sse_event,
)
from mlxserve.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from mlxserve.api.handlers import GenerationRun, accept, render_chat, start_chat
from mlxserve.api.keepalive import with_keepalive
from mlxserve.api.pipeline import EngineRequestFailed
from mlxserve.api.state import ServerState
from mlxserve.api.stream import ResponseMeta


async def _events(
    run: GenerationRun, writer: MessageEvents, keepalive_s: float
) -> AsyncIterator[bytes]:
    pipeline = run.pipeline
    for event in writer.start(pipeline.usage):
        yield sse_event(event)
    yield sse_event(PING)
    try:
        async for delta in with_keepalive(run.deltas(), keepalive_s):
            if delta is None:
                yield sse_event(PING)
                continue
            for event in writer.delta(delta):
                yield sse_event(event)
            if delta.finish_reason is not None:
                for event in writer.finish(
                    delta.finish_reason, pipeline.stop_string, pipeline.usage
                ):
                    yield sse_event(event)
    except EngineRequestFailed as e:
        yield sse_event(error_event(f"generation failed: {e}"))


async def _message(run: GenerationRun, meta: MessageMeta) -> dict[str, Any]:
    acc = await run.accumulate()
    return message_body(meta, acc, run.pipeline.usage, run.pipeline.stop_string)


async def messages(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req, model = await accept(state, request, MessagesRequest)
    gen = to_generation(req)
    meta = ResponseMeta(
        id=f"msg_{uuid.uuid4().hex[:24]}",
        model=state.model_name,
        created=int(time.time()),
        kind="messages",
    )
    _, run = await start_chat(state, model, gen, meta, arrival)
    message_meta = MessageMeta(meta.id, meta.model, show_thinking=show_thinking(req))
    if gen.stream:
        writer = MessageEvents(message_meta)
        return run.stream_response(_events(run, writer, state.config.keepalive_interval_s))
    return await run.json_response(request, _message(run, message_meta))


async def count_tokens(state: ServerState, request: Request) -> Response:
    req, model = await accept(state, request, CountTokensRequest)
    prompt = await render_chat(model, prompt_request(req))
    return JSONResponse({"input_tokens": len(prompt.token_ids)})
