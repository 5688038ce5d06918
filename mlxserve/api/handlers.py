"""The generation endpoints: chat completions and text completions.

A request is validated, rendered to token ids (in a worker thread: long
prompts take milliseconds to tokenize), submitted to the engine, and its
token events run through the output pipeline. Streaming sends SSE chunks;
non-streaming folds the same deltas. A client that goes away aborts its
engine request at once (streaming: Starlette cancels the generator;
non-streaming: a watcher on the ASGI receive channel).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from mlxserve.api.detok import CONTEXT_TOKENS
from mlxserve.api.errors import APIError, GenerationFailed, error_body
from mlxserve.api.generation import ChatGeneration, Sampling
from mlxserve.api.keepalive import SSE_COMMENT, with_keepalive
from mlxserve.api.notices import warn_once
from mlxserve.api.pipeline import Accumulator, EngineRequestFailed, OutputDelta, OutputPipeline
from mlxserve.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from mlxserve.api.state import ServerState
from mlxserve.api.stream import (
    DONE,
    ResponseMeta,
    chat_delta_chunk,
    chat_response,
    chat_role_chunk,
    finish_chunk,
    sse,
    text_delta_chunk,
    text_response,
    usage_chunk,
)
from mlxserve.api.structured import OutputConstraint, StructuredOutputError, constraint_grammar
from mlxserve.chat import PromptError, PromptIds, PromptRequest, render_prompt
from mlxserve.engine.request import Constraint, TokenEvent
from mlxserve.models.loaded import LoadedModel

logger = logging.getLogger(__name__)

THINK_END = "</think>"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready."""


def thinking_mode(prompt_text: str, model: LoadedModel) -> bool:
    """Whether the model starts its answer inside reasoning.

    DeepSeek prompts end with `<think>` (thinking) or `</think>` (chat);
    Qwen3 templates leave thinking on unless they closed an empty block.
    """
    tail = prompt_text.rstrip()
    if tail.endswith("<think>"):
        return True
    if tail.endswith("</think>"):
        return False
    return model.chat_encoder == "template" and model.model_type.startswith("qwen3")


class _GuardedStream(StreamingResponse):
    """A streaming response that aborts its engine request however it ends.

    Starlette never starts the body generator when the client is gone before
    the response starts; the guard still frees the engine slot then.
    """

    def __init__(self, run: GenerationRun, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.abort_if_running()


class GenerationRun:
    """One submitted request: its engine events, pipeline, and response shape."""

    def __init__(
        self,
        state: ServerState,
        meta: ResponseMeta,
        pipeline: OutputPipeline,
        events: AsyncIterator[TokenEvent],
        arrival: float,
    ) -> None:
        self.state = state
        self.meta = meta
        self.pipeline = pipeline
        self.events = events
        self.arrival = arrival
        self.outcome = "aborted"
        self.engine_finished = False
        self._aborted = False

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        """Pipeline output until the request finishes; aborts it if left early."""
        last_token: float | None = None
        try:
            async for event in self.events:
                self.engine_finished = event.finished
                if event.token_id is not None:
                    last_token = self._observe_token(last_token)
                delta = self.pipeline.step(event)
                if not delta.empty:
                    yield delta
                if self.pipeline.done:
                    break
            self.outcome = "ok" if self.pipeline.done else "aborted"
        except EngineRequestFailed:
            self.outcome = "error"
            raise
        finally:
            await self._close()

    def _observe_token(self, previous: float | None) -> float:
        """Time to first token, then the gaps between tokens; returns this token's time."""
        now = time.monotonic()
        if previous is None:
            self.state.metrics.observe_ttft(now - self.arrival)
        else:
            self.state.metrics.observe_itl(now - previous)
        return now

    def abort_if_running(self) -> None:
        """Tell the engine we are done: a matched stop string is a normal stop, else abort."""
        if not self.engine_finished and not self._aborted:
            self._aborted = True
            if self.pipeline.stopped_by_string:
                self.state.engine.finish(self.meta.id)
            else:
                self.state.engine.abort(self.meta.id)

    async def _close(self) -> None:
        self.abort_if_running()
        closer = getattr(self.events, "aclose", None)
        if closer is not None:
            with anyio.CancelScope(shield=True):
                await closer()
        u = self.pipeline.usage
        m = self.state.metrics
        m.count_tokens(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        m.count_request(self.meta.kind, self.outcome)
        if self.outcome == "ok":
            m.observe_e2e(time.monotonic() - self.arrival)

    async def sse(self) -> AsyncIterator[bytes]:
        meta = self.meta
        if meta.kind == "chat":
            yield sse(chat_role_chunk(meta))
        offset = 0
        interval = self.state.config.keepalive_interval_s
        try:
            # Keep-alive comments while nothing comes (a long prefill), so proxies stay open.
            ticking = with_keepalive(self.deltas(), interval)
            closing = cast(AsyncGenerator[OutputDelta | None, None], ticking)
            async with contextlib.aclosing(closing) as deltas:
                async for delta in deltas:
                    if delta is None:
                        yield SSE_COMMENT
                        continue
                    if meta.kind == "chat":
                        chunk = chat_delta_chunk(meta, delta)
                    else:
                        chunk = text_delta_chunk(meta, delta, offset)
                        offset += len(delta.content)
                    if chunk is not None:
                        yield sse(chunk)
                    if delta.finish_reason is not None:
                        yield sse(finish_chunk(meta, delta.finish_reason))
        except EngineRequestFailed as e:
            yield sse(error_body(str(e), "server_error", code="generation_failed"))
        if meta.include_usage:
            yield sse(usage_chunk(meta, self.pipeline.usage))
        yield DONE

    async def accumulate(self) -> Accumulator:
        """The whole output folded into one message; APIError 500 if the engine failed it."""
        acc = Accumulator()
        try:
            async for delta in self.deltas():
                acc.add(delta)
        except EngineRequestFailed as e:
            raise GenerationFailed(str(e)) from e
        return acc

    async def collect(self) -> dict[str, Any]:
        acc = await self.accumulate()
        build = chat_response if self.meta.kind == "chat" else text_response
        return build(self.meta, acc, self.pipeline.usage)

    async def respond(self, request: Request, stream: bool) -> Response:
        """The OpenAI answer: SSE chunks or one JSON body."""
        if stream:
            return self.stream_response(self.sse())
        return await self.json_response(request, self.collect())

    def stream_response(self, body: AsyncIterator[bytes]) -> Response:
        """Stream `body` (built from this run); the engine request ends with it."""
        return _GuardedStream(self, body)

    async def json_response(self, request: Request, work: Awaitable[dict[str, Any]]) -> Response:
        """Await `work` (built from this run), aborting it if the client disconnects."""
        return JSONResponse(await _until_disconnect(request, work))


async def _until_disconnect(request: Request, work: Any) -> dict[str, Any]:
    """Run `work`; cancel it (aborting the engine request) if the client disconnects."""
    task: asyncio.Task[dict[str, Any]] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def render_chat(model: LoadedModel, prompt: PromptRequest) -> PromptIds:
    """The prompt's text and token ids (in a worker thread); 400 for a bad conversation."""
    try:
        return await asyncio.to_thread(render_prompt, model, prompt)
    except (PromptError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from e


def _meta(
    state: ServerState, prefix: str, kind: str, req: ChatCompletionRequest | CompletionRequest
) -> ResponseMeta:
    return ResponseMeta(
        id=f"{prefix}-{uuid.uuid4().hex}",
        model=state.model_name,
        created=int(time.time()),
        kind=kind,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def start_run(
    state: ServerState,
    model: LoadedModel,
    ids: list[int],
    sampling: Sampling,
    meta: ResponseMeta,
    arrival: float,
    stops: Sequence[str] = (),
    constraint: Constraint | None = None,
    **pipeline_options: Any,
) -> GenerationRun:
    """Submit the prompt; the run yields the pipeline's output."""
    params = state.sampling_params(model, sampling, len(ids))
    if constraint is not None:
        params = replace(params, constraint=constraint)
    pipeline = OutputPipeline(
        model.tokenizer,
        model.eos_token_ids,
        len(ids),
        stops=stops,
        logprobs=params.logprobs,
        prompt_tail=ids[-CONTEXT_TOKENS:],
        **pipeline_options,
    )
    events = state.submit(ids, params, meta.id)
    return GenerationRun(state, meta, pipeline, events, arrival)


async def start_chat(
    state: ServerState,
    model: LoadedModel,
    gen: ChatGeneration,
    meta: ResponseMeta,
    arrival: float,
) -> tuple[PromptIds, GenerationRun]:
    """Render a chat request and submit it, with the model's reasoning and tool parsers."""
    prompt = await render_chat(model, gen.prompt)
    thinking = thinking_mode(prompt.text, model)
    spec = state.parsers(model)
    parser = spec.create(thinking=thinking, tools_given=gen.tools_enabled)
    constraint = None
    if gen.constraint is not None:
        constraint = await _engine_constraint(model, gen.constraint, spec.tool, thinking)
    run = start_run(
        state,
        model,
        prompt.token_ids,
        gen.sampling,
        meta,
        arrival,
        stops=gen.stops,
        constraint=constraint,
        parser=parser,
        parallel_tool_calls=gen.parallel_tool_calls,
    )
    return prompt, run


async def _engine_constraint(
    model: LoadedModel, wanted: OutputConstraint, tool_syntax: str, thinking: bool
) -> Constraint | None:
    """The engine's grammar for a structured answer; in thinking mode it starts after `</think>`."""
    param = "response_format" if wanted.json_schema is not None else "tool_choice"
    try:
        grammar = await asyncio.to_thread(constraint_grammar, wanted, tool_syntax)
    except StructuredOutputError as e:
        if wanted.optional:
            # `strict` on an optional call is best effort: the request is served free.
            warn_once("strict-tools", "strict tool calls are not enforced: %s", e)
            return None
        raise APIError(400, str(e), param=param) from e
    if not thinking:
        return Constraint(grammar)
    end = model.tokenizer.encode(THINK_END, add_special_tokens=False)
    if len(end) != 1:
        raise APIError(
            400,
            f"structured output in thinking mode needs a single {THINK_END} token; "
            "turn thinking off for this request",
            param=param,
        )
    return Constraint(grammar, start_after=(int(end[0]),))


RequestT = TypeVar("RequestT", bound=BaseModel)


async def accept(
    state: ServerState, request: Request, schema: type[RequestT]
) -> tuple[RequestT, LoadedModel]:
    """The validated body and the model to serve it (4xx/503 otherwise)."""
    req = parse_body(schema, await request.body())
    check = getattr(req, "check_supported", None)
    if check is not None:
        check()
    state.check_model_name(getattr(req, "model", None))
    return req, state.require_model()


async def chat_completions(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req, model = await accept(state, request, ChatCompletionRequest)
    meta = _meta(state, "chatcmpl", "chat", req)
    _, run = await start_chat(state, model, req.to_generation(), meta, arrival)
    return await run.respond(request, bool(req.stream))


def _completion_ids(model: LoadedModel, req: CompletionRequest) -> list[int]:
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        ids = [int(i) for i in model.tokenizer.encode(prompt)]
    else:
        ids = prompt
        bad = [i for i in ids if not 0 <= i < model.vocab_size]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is out of range", param="prompt")
    if not ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return ids


async def completions(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req, model = await accept(state, request, CompletionRequest)
    ids = await asyncio.to_thread(_completion_ids, model, req)
    meta = _meta(state, "cmpl", "text", req)
    run = start_run(
        state, model, ids, req.to_sampling(), meta, arrival, stops=req.stop_strings(), parser=None
    )
    return await run.respond(request, bool(req.stream))
