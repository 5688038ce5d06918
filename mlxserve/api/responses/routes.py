"""The OpenAI Responses endpoints: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`.

A thin edge over the shared run: `convert` turns the body (and the stored
conversation `previous_response_id` names) into the internal request,
`start_chat` renders and submits it (same encoder, engine, parsers and
prefix cache as every dialect), and `ResponseEvents` writes the pipeline's
deltas as Responses events (streamed) or one response object; a finished
response the client asked to store goes to the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api.errors import APIError
from mlxserve.api.models import ServedModels
from mlxserve.api.responses.convert import ResponsesTurn, echo_settings, to_turn
from mlxserve.api.responses.events import ResponseEvents, ResponseShell, new_item_id
from mlxserve.api.responses.protocol import ResponsesRequest
from mlxserve.api.responses.store import ResponseStore
from mlxserve.api.run import GenerationRun, RunMeta, accept, new_meta, start_chat
from mlxserve.api.state import ServerState
from mlxserve.api.writer import respond
from mlxserve.models.loaded import LoadedModel

# The shared checks name chat-completions fields; a Responses client wrote these.
# Rendering names the chat messages the input became; the client sent `input`.
_PARAMS = {"messages": "input"}


async def _start(
    state: ServerState, model: LoadedModel, turn: ResponsesTurn, meta: RunMeta, arrival: float
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
        return len(model.tokenizer.encode(text, add_special_tokens=False))

    return count


class ResponsesAPI:
    """The Responses routes over one store of responses."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def create(self, server: ServedModels, request: Request) -> Response:
        arrival = time.monotonic()
        req, state, model = await accept(server, request, ResponsesRequest)
        history: tuple[Mapping[str, Any], ...] = ()
        if req.previous_response_id is not None:
            history = self.store.previous(req.previous_response_id).items
        turn = to_turn(req, history)
        meta = new_meta(state, "resp_", "responses")
        run = await _start(state, model, turn, meta, arrival)
        shell = ResponseShell(
            meta.id,
            meta.model,
            meta.created,
            echo_settings(req),
            include_encrypted=req.include_encrypted,
            include_logprobs=req.include_logprobs,
            namespaces=turn.namespaces,
        )

        def keep(body: Mapping[str, Any]) -> None:
            if req.stores:
                self.store.put(body, (*turn.items, *body["output"]))

        writer = ResponseEvents(shell, new_item_id, _token_counter(model), keep)
        return await respond(request, run, writer, turn.generation.stream)

    def retrieve(self, response_id: str) -> JSONResponse:
        return JSONResponse(dict(self.store.get(response_id).body))

    def delete(self, response_id: str) -> JSONResponse:
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
