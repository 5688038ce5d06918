"""One generation run, whatever dialect asked for it: accept, render, submit, deltas.

A route parses its body (`accept`), converts it to the internal request,
and `start_chat` renders the prompt (in a worker thread: long prompts take
milliseconds to tokenize), builds its grammar, and submits it. The engine's
token events run through the output pipeline (`GenerationRun.deltas`); the
engine request is aborted however the run ends early. `writer` turns the
deltas into a dialect's stream or body.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel

from mlxserve.api.body import parse_body
from mlxserve.api.detok import CONTEXT_TOKENS
from mlxserve.api.errors import APIError, GenerationFailed
from mlxserve.api.generation import ChatGeneration, Sampling
from mlxserve.api.images import no_count, settle_images
from mlxserve.api.models import ServedModels
from mlxserve.api.notices import warn_once
from mlxserve.api.pipeline import Accumulator, EngineRequestFailed, OutputDelta, OutputPipeline
from mlxserve.api.state import ServerState
from mlxserve.api.status.board import CURRENT_CALL, RunRecord, StatusBoard
from mlxserve.api.structured import OutputConstraint, StructuredOutputError, constraint_grammar
from mlxserve.chat import PromptError, PromptIds, PromptRequest, render_prompt
from mlxserve.engine.request import Constraint, TokenEvent
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.vision import IMAGE_KEY_BASE, PromptImage

logger = logging.getLogger(__name__)

THINK_END = "</think>"


@dataclass(frozen=True)
class RunMeta:
    """What every event of one response repeats; `kind` labels its metrics."""

    id: str
    model: str
    created: int
    kind: str = "chat"


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


class GenerationRun:
    """One submitted request: its engine events, pipeline, and response shape."""

    def __init__(
        self,
        state: ServerState,
        meta: RunMeta,
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
        state.live_runs.add(self)
        # Its line on the status page (runs started outside an HTTP request have none).
        self.record: RunRecord | None = None
        self.board: StatusBoard | None = None
        call = CURRENT_CALL.get()
        if call is not None:
            self.board = call.board
            prompt = pipeline.usage.prompt_tokens
            self.record = call.board.open(self, call, meta.id, state.model_name, prompt)

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        """Pipeline output until the request finishes; aborts it if left early."""
        last_token: float | None = None
        try:
            async for event in self.events:
                self.engine_finished = event.finished
                if event.token_id is not None:
                    last_token = self._observe_token(last_token)
                if event.cached_tokens and self.record is not None:
                    self.record.cached_tokens = event.cached_tokens
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
        record, board = self.record, self.board
        if record is not None and board is not None:
            record.generated_tokens += 1
            record.last_token = now
            if record.first_token is None:
                board.first_token(record, now)
        return now

    def report_failure(self, message: str) -> None:
        """A failure the client hears of inside a stream (its HTTP status was 200)."""
        if self.board is not None and self.record is not None:
            self.board.error(self.record.route, 500, message, self.meta.model)

    def abort_if_running(self) -> None:
        """Tell the engine we are done: a matched stop string is a normal stop, else abort.
        The run leaves the status board here, however its response ended."""
        if self.board is not None:
            self.board.close(self.meta.id)
        if not self.engine_finished and not self._aborted:
            self._aborted = True
            if self.pipeline.stopped_by_string:
                self.state.engine.finish(self.meta.id)
            else:
                self.state.engine.abort(self.meta.id)

    async def _close(self) -> None:
        self.abort_if_running()  # (which takes the run off the status board)
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

    async def accumulate(self) -> Accumulator:
        """The whole output folded into one message; APIError 500 if the engine failed it."""
        acc = Accumulator()
        try:
            async for delta in self.deltas():
                acc.add(delta)
        except EngineRequestFailed as e:
            raise GenerationFailed(str(e)) from e
        return acc


async def render_chat(
    state: ServerState,
    model: LoadedModel,
    prompt: PromptRequest,
    *,
    text_models: str | None = None,
    count_images: bool = True,
) -> PromptIds:
    """The prompt's text and token ids (in a worker thread); 400 for a bad conversation.

    Its images are checked and placed first, in the same thread (decoding is CPU
    work): `text_models` overrides the model's --images-for-text-models, and
    `count_images` says whether they count in /metrics (not for count_tokens)."""
    policy = state.image_policy
    if text_models is not None:
        policy = replace(policy, text_models=text_models)
    counter = state.metrics.count_images if count_images else no_count

    def render() -> PromptIds:
        settled = settle_images(
            prompt,
            model_name=state.model_name,
            reads_images=model.reads_images,
            policy=policy,
            count=counter,
        )
        return render_prompt(model, settled)

    try:
        return await asyncio.to_thread(render)
    except (PromptError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from e


def new_meta(state: ServerState, prefix: str, kind: str, hex_digits: int = 32) -> RunMeta:
    """A fresh response id (`prefix` + random hex) for the model this server names."""
    response_id = prefix + uuid.uuid4().hex[:hex_digits]
    return RunMeta(response_id, state.model_name, int(time.time()), kind)


def start_run(
    state: ServerState,
    model: LoadedModel,
    ids: list[int],
    sampling: Sampling,
    meta: RunMeta,
    arrival: float,
    stops: Sequence[str] = (),
    constraint: Constraint | None = None,
    images: tuple[PromptImage, ...] = (),
    **pipeline_options: Any,
) -> GenerationRun:
    """Submit the prompt (with its images' places, for a model that reads them); the run
    yields the pipeline's output."""
    params = state.sampling_params(model, sampling, len(ids))
    if constraint is not None:
        params = replace(params, constraint=constraint)
    pipeline = OutputPipeline(
        model.tokenizer,
        model.eos_token_ids,
        len(ids),
        stops=stops,
        logprobs=params.logprobs,
        # (An image's keyed ids are no text the detokenizer could read.)
        prompt_tail=[t for t in ids[-CONTEXT_TOKENS:] if t < IMAGE_KEY_BASE],
        **pipeline_options,
    )
    events = state.submit(ids, params, meta.id, images=images)
    return GenerationRun(state, meta, pipeline, events, arrival)


async def start_chat(
    state: ServerState,
    model: LoadedModel,
    gen: ChatGeneration,
    meta: RunMeta,
    arrival: float,
) -> tuple[PromptIds, GenerationRun]:
    """Render a chat request and submit it, with the model's reasoning and tool parsers."""
    prompt = await render_chat(state, model, gen.prompt)
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
        images=prompt.images,
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
    server: ServedModels, request: Request, schema: type[RequestT]
) -> tuple[RequestT, ServerState, LoadedModel]:
    """The validated body, the served model it names and that model, loaded (4xx/503
    otherwise)."""
    req = parse_body(schema, await request.body())
    check = getattr(req, "check_supported", None)
    if check is not None:
        check()
    state = server.route(getattr(req, "model", None))
    return req, state, state.require_model()
