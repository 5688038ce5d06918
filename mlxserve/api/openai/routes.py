"""The OpenAI endpoints: `/v1/chat/completions` and `/v1/completions`.

A thin edge over the shared run: `convert` turns the body into the internal
request, `start_chat` / `start_run` submit it, and `ChunkWriter` writes the
pipeline's deltas as chunks (streamed) or one response object.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import Response

from mlxserve.api.models import ServedModels
from mlxserve.api.openai.convert import chat_generation, completion_ids, completion_sampling
from mlxserve.api.openai.events import ChunkWriter, ResponseMeta
from mlxserve.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from mlxserve.api.run import RunMeta, accept, new_meta, start_chat, start_run
from mlxserve.api.writer import respond


def _writer(meta: RunMeta, req: ChatCompletionRequest | CompletionRequest) -> ChunkWriter:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ChunkWriter(ResponseMeta(meta.id, meta.model, meta.created, meta.kind, include_usage))


async def chat_completions(server: ServedModels, request: Request) -> Response:
    arrival = time.monotonic()
    req, state, model = await accept(server, request, ChatCompletionRequest)
    gen = chat_generation(req)
    meta = new_meta(state, "chatcmpl-", "chat")
    _, run = await start_chat(state, model, gen, meta, arrival)
    return await respond(request, run, _writer(meta, req), gen.stream)


async def completions(server: ServedModels, request: Request) -> Response:
    arrival = time.monotonic()
    req, state, model = await accept(server, request, CompletionRequest)
    ids = await asyncio.to_thread(completion_ids, model, req)
    meta = new_meta(state, "cmpl-", "text")
    sampling = completion_sampling(req)
    run = start_run(
        state, model, ids, sampling, meta, arrival, stops=req.stop_strings(), parser=None
    )
    return await respond(request, run, _writer(meta, req), bool(req.stream))
