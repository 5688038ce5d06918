"""What the routes share: the engine, settings, metrics, and request -> engine input."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from mlxserve.api.errors import APIError
from mlxserve.api.metrics import Metrics
from mlxserve.api.protocol import ChatCompletionRequest, CompletionRequest
from mlxserve.config import ServerConfig
from mlxserve.engine.request import EngineNotReady, EngineOverloaded, SamplingParams, TokenEvent
from mlxserve.models.loaded import LoadedModel
from mlxserve.parsers import ParserSpec, resolve_parsers

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096
RETRY_AFTER_S = "1"
T = TypeVar("T")


class EngineLike(Protocol):
    """The part of `AsyncEngine` the API uses."""

    @property
    def ready(self) -> bool: ...

    @property
    def load_error(self) -> str | None: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def model(self) -> LoadedModel: ...

    def start(self) -> None: ...

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenEvent]: ...

    def abort(self, request_id: str) -> None: ...

    def finish(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    async def shutdown(self) -> None: ...


@dataclass
class ServerState:
    engine: EngineLike
    config: ServerConfig
    model_name: str
    max_model_len: int | None = None
    metrics: Metrics = field(default_factory=Metrics)
    # Called with (request_id, prompt_ids) for every submitted request (tests, tracing).
    on_submit: Callable[[str, list[int]], None] | None = None
    # Called once with the reason when the engine thread dies (`serve` ends the process).
    on_engine_failure: Callable[[str], None] | None = None
    _parsers: ParserSpec | None = None

    def require_model(self) -> LoadedModel:
        """The loaded model, or 503 while it loads (or failed to load, or the engine died)."""
        if self.engine.failure is not None:
            raise APIError(503, f"the engine failed: {self.engine.failure}", code="engine_failed")
        if self.engine.load_error is not None:
            raise APIError(503, f"model failed to load: {self.engine.load_error}")
        if not self.engine.ready:
            raise APIError(
                503, "model is still loading", code="model_loading", headers={"Retry-After": "5"}
            )
        try:
            return self.engine.model
        except EngineNotReady as e:
            raise APIError(503, str(e) or "model is not ready") from e

    def check_model_name(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, ""):
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def parsers(self, model: LoadedModel) -> ParserSpec:
        if self._parsers is None:
            vocab = model.tokenizer.get_vocab() if hasattr(model.tokenizer, "get_vocab") else None
            self._parsers = resolve_parsers(
                model.model_type,
                vocab,
                reasoning=self.config.reasoning_parser,
                tool=self.config.tool_call_parser,
            )
            logger.info(
                "parsers: reasoning=%s tool=%s", self._parsers.reasoning, self._parsers.tool
            )
        return self._parsers

    def context_limit(self, model: LoadedModel) -> int | None:
        if self.max_model_len is not None:
            return self.max_model_len
        value = model.config.get("max_position_embeddings")
        return value if isinstance(value, int) and value > 0 else None

    def max_tokens(self, model: LoadedModel, requested: int | None, prompt_len: int) -> int:
        """The request's token budget; 400 when the prompt plus it exceeds the context."""
        limit = self.context_limit(model)
        if limit is not None and prompt_len >= limit:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; this server's context limit "
                f"(--max-model-len) is {limit}",
                param="messages",
                code="context_length_exceeded",
            )
        if requested is None:
            return DEFAULT_MAX_TOKENS if limit is None else limit - prompt_len
        if requested < 1:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
        if limit is not None and prompt_len + requested > limit:
            raise APIError(
                400,
                f"prompt ({prompt_len} tokens) + max_tokens ({requested}) exceeds this "
                f"server's context limit (--max-model-len) of {limit}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self,
        model: LoadedModel,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_len: int,
    ) -> SamplingParams:
        requested = (
            req.effective_max_tokens if isinstance(req, ChatCompletionRequest) else req.max_tokens
        )
        if isinstance(req, ChatCompletionRequest):
            logprobs = bool(req.logprobs)
            top = req.top_logprobs or 0
        else:
            logprobs = req.logprobs is not None
            top = req.logprobs or 0
        try:
            return SamplingParams(
                max_tokens=self.max_tokens(model, requested, prompt_len),
                temperature=_or(req.temperature, 1.0),
                top_p=_or(req.top_p, 1.0),
                top_k=_or(req.top_k, 0),
                min_p=_or(req.min_p, 0.0),
                seed=req.seed,
                repetition_penalty=_or(req.repetition_penalty, 1.0),
                presence_penalty=_or(req.presence_penalty, 0.0),
                frequency_penalty=_or(req.frequency_penalty, 0.0),
                logit_bias=_logit_bias(req.logit_bias, model.vocab_size),
                logprobs=logprobs,
                top_logprobs=top,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[TokenEvent]:
        try:
            events = self.engine.submit(prompt_ids, params, request_id)
        except EngineOverloaded as e:
            raise APIError(
                429,
                f"the server is overloaded ({e or 'waiting queue full'}); retry shortly",
                code="overloaded",
                headers={"Retry-After": RETRY_AFTER_S},
            ) from e
        except EngineNotReady as e:
            raise APIError(503, str(e) or "model is not ready") from e
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        if self.on_submit is not None:
            self.on_submit(request_id, list(prompt_ids))
        return events


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out: list[tuple[int, float]] = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError as e:
            raise APIError(
                400, f"logit_bias key {key!r} is not a token id", param="logit_bias"
            ) from e
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias token id {token} is out of range", param="logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, "logit_bias values must be in [-100, 100]", param="logit_bias")
        out.append((token, float(value)))
    return tuple(sorted(out))
