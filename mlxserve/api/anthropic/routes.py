"""The Anthropic Messages endpoints: `/v1/messages` and `/v1/messages/count_tokens`.

A thin edge over the shared run: `convert` turns the body into the internal
request, `start_chat` renders and submits it (same encoder, engine, parsers
and prefix cache as every dialect), and `MessageEvents` writes the
pipeline's deltas as Anthropic events (streamed) or one message.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api.anthropic.convert import prompt_request, show_thinking, to_generation
from mlxserve.api.anthropic.events import MessageEvents, MessageMeta
from mlxserve.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from mlxserve.api.models import ServedModels
from mlxserve.api.run import accept, new_meta, render_chat, start_chat
from mlxserve.api.writer import respond

# Anthropic message ids: `msg_` and 24 hex digits.
ID_HEX = 24


async def messages(server: ServedModels, request: Request) -> Response:
    arrival = time.monotonic()
    req, state, model = await accept(server, request, MessagesRequest)
    gen = to_generation(req)
    meta = new_meta(state, "msg_", "messages", ID_HEX)
    _, run = await start_chat(state, model, gen, meta, arrival)
    writer = MessageEvents(MessageMeta(meta.id, meta.model, show_thinking=show_thinking(req)))
    return await respond(request, run, writer, gen.stream)


async def count_tokens(server: ServedModels, request: Request) -> Response:
    req, state, model = await accept(server, request, CountTokensRequest)
    # An image counts as its placeholder note's tokens, whatever the model's mode: the
    # count is an estimate a client plans with, and a refusal is the request's to answer.
    prompt = await render_chat(
        state, model, prompt_request(req), text_models="placeholder", count_images=False
    )
    return JSONResponse({"input_tokens": len(prompt.token_ids)})
