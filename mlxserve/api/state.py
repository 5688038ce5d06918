"""What the routes share: the engine, settings, metrics, and request -> engine input."""

from __future__ import annotations

import logging
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mlxserve.api.errors import APIError
from mlxserve.api.generation import Sampling
from mlxserve.api.images import ImagePolicy
from mlxserve.api.metrics import Metrics, ModelMetrics
from mlxserve.config import ServerConfig
from mlxserve.engine.request import EngineNotReady, EngineOverloaded, SamplingParams, TokenEvent
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.progress import LoadProgress
from mlxserve.models.vision import PromptImage
from mlxserve.parsers import ParserSpec, resolve_parsers
from mlxserve.parsers.registry import TokenNames

if TYPE_CHECKING:
    from mlxserve.engine.async_engine import RequestProgress

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096
# The context limit of a model whose config names none and no --max-model-len.
DEFAULT_CONTEXT_LIMIT = 32768
# Config fields real checkpoints use for their context length, in order of trust.
CONTEXT_FIELDS = (
    "max_position_embeddings",
    "max_seq_len",
    "max_sequence_length",
    "seq_length",
    "n_positions",
    "model_max_length",
    "n_ctx",
)
# Multimodal and wrapper configs keep the language model's fields in a sub-config.
NESTED_CONFIGS = ("text_config", "language_config", "llm_config")
# HF tokenizers report about 1e30 when tokenizer_config.json names no limit.
_TOKENIZER_LIMIT_MAX = 1 << 40
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
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: tuple[PromptImage, ...] = (),
    ) -> AsyncIterator[TokenEvent]: ...

    def abort(self, request_id: str) -> None: ...

    def finish(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def progress(self, request_id: str) -> RequestProgress | None: ...

    async def shutdown(self) -> None: ...


@dataclass
class ServerState:
    """One served model: its engine, names, parsers, limits and metrics."""

    engine: EngineLike
    config: ServerConfig
    model_name: str
    max_model_len: int | None = None
    metrics: ModelMetrics = field(default=None)  # type: ignore[assignment]
    # Called with (request_id, prompt_ids) for every submitted request (tests, tracing).
    on_submit: Callable[[str, list[int]], None] | None = None
    # Every name the model answers to (--served-model-name A B ...); model_name is the first.
    aliases: tuple[str, ...] = ()
    # How far the model load has got (/health reports it while loading).
    load_progress: LoadProgress | None = None
    # Called once with the reason when the engine thread dies (`serve` ends the process).
    on_engine_failure: Callable[[str], None] | None = None
    # Called once with the reason when the model fails to load at start (`serve` exits).
    on_load_failure: Callable[[str], None] | None = None
    # Every run of this model not yet garbage collected: in flight, or leaked (/metrics).
    live_runs: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    _parsers: ParserSpec | None = None
    _context_limit: int | None = None

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = Metrics().for_model(self.model_name)

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

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names this model answers to: the served name first, then the other aliases."""
        return (self.model_name, *(a for a in self.aliases if a != self.model_name))

    @property
    def image_policy(self) -> ImagePolicy:
        """What this model does with images (its limits and its text-only mode)."""
        return ImagePolicy.of(self.config)

    def parsers(self, model: LoadedModel) -> ParserSpec:
        if self._parsers is None:
            tokenizer = model.tokenizer
            vocab = TokenNames(tokenizer) if hasattr(tokenizer, "convert_tokens_to_ids") else None
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

    def context_limit(self, model: LoadedModel) -> int:
        """Tokens a request may span: the model's own limit, capped by --max-model-len.

        The model's limit comes from its config (the fields real checkpoints
        use, nested text configs included), else its tokenizer; a model with
        neither gets --max-model-len, else DEFAULT_CONTEXT_LIMIT (logged).
        """
        if self._context_limit is None:
            self._context_limit = self._resolve_context_limit(model)
        return self._context_limit

    def _resolve_context_limit(self, model: LoadedModel) -> int:
        found = model_context_length(model.config, model.tokenizer)
        cap = self.max_model_len
        if found is None:
            if cap is not None:
                return cap
            logger.warning(
                "the model's config names no context length; limiting requests to %d tokens "
                "(set --max-model-len to change it)",
                DEFAULT_CONTEXT_LIMIT,
            )
            return DEFAULT_CONTEXT_LIMIT
        source, value = found
        if cap is None:
            logger.info("context limit %d tokens (%s)", value, source)
            return value
        if cap > value:
            logger.warning(
                "--max-model-len %d exceeds the model's %s of %d; using %d",
                cap,
                source,
                value,
                value,
            )
            return value
        return cap

    def max_tokens(self, model: LoadedModel, sampling: Sampling, prompt_len: int) -> int:
        """The request's token budget; 400 when the prompt plus it exceeds the context.

        With `clamp_max_tokens` (the Anthropic route) a budget past the context is cut
        to what fits instead; a prompt that alone does not fit is a 400 anyway.
        """
        limit = self.context_limit(model)
        requested, budget_param = sampling.max_tokens, sampling.max_tokens_param
        if prompt_len >= limit:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; this server's context limit is {limit}",
                param=sampling.prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return min(DEFAULT_MAX_TOKENS, limit - prompt_len)
        if requested < 1:
            raise APIError(400, f"{budget_param} must be at least 1", param=budget_param)
        if prompt_len + requested > limit and sampling.clamp_max_tokens:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise APIError(
                400,
                f"prompt ({prompt_len} tokens) + {budget_param} ({requested}) exceeds this "
                f"server's context limit of {limit} tokens",
                param=budget_param,
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self, model: LoadedModel, sampling: Sampling, prompt_len: int
    ) -> SamplingParams:
        """Engine sampling settings for a request; 400 for values the model cannot take."""
        max_tokens = self.max_tokens(model, sampling, prompt_len)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=_or(sampling.temperature, 1.0),
                top_p=_or(sampling.top_p, 1.0),
                top_k=0 if sampling.top_k == -1 else _or(sampling.top_k, 0),
                min_p=_or(sampling.min_p, 0.0),
                seed=sampling.seed,
                repetition_penalty=_or(sampling.repetition_penalty, 1.0),
                presence_penalty=_or(sampling.presence_penalty, 0.0),
                frequency_penalty=_or(sampling.frequency_penalty, 0.0),
                logit_bias=_logit_bias(sampling.logit_bias, model.vocab_size),
                logprobs=sampling.logprobs,
                top_logprobs=sampling.top_logprobs,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        images: tuple[PromptImage, ...] = (),
    ) -> AsyncIterator[TokenEvent]:
        try:
            if images:
                events = self.engine.submit(prompt_ids, params, request_id, images=images)
            else:
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
        owner = _OWNER.get()
        if owner is not None:
            owner.append((self.engine, request_id))
        if self.on_submit is not None:
            self.on_submit(request_id, list(prompt_ids))
        return events


@contextmanager
def owning_requests() -> Iterator[list[tuple[EngineLike, str]]]:
    """Own what `ServerState.submit` starts inside this block: if the block raises (before
    its response has taken the request over), those engine requests are aborted."""
    owned: list[tuple[EngineLike, str]] = []
    token = _OWNER.set(owned)
    try:
        yield owned
    except BaseException:
        for engine, request_id in owned:
            engine.abort(request_id)
        raise
    finally:
        _OWNER.reset(token)


# The (engine, request id) pairs submitted while building the current HTTP request's response.
_OWNER: ContextVar[list[tuple[EngineLike, str]] | None] = ContextVar(
    "mlxserve_request_owner", default=None
)


def model_context_length(config: dict[str, Any], tokenizer: Any = None) -> tuple[str, int] | None:
    """(where it was found, value) of a model's context length, or None."""
    for where, cfg in [("config", config)] + [
        (key, config[key]) for key in NESTED_CONFIGS if isinstance(config.get(key), dict)
    ]:
        for key in CONTEXT_FIELDS:
            value = cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return (key if where == "config" else f"{where}.{key}"), value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < _TOKENIZER_LIMIT_MAX:
        return "tokenizer model_max_length", value
    return None


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
