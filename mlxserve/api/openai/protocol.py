"""Request schemas of OpenAI chat and text completions (pydantic v2, strict types).

Parsed by `body.parse_body`: a wrong type is a 400 naming the field. Unknown
fields are accepted and ignored (clients send `store`, `metadata`, ...).
Fields that would change the meaning of the answer and are not implemented
are refused with a clear 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from mlxserve.api.body import FunctionSpec, Strict, TopLogprobs
from mlxserve.api.errors import APIError
from mlxserve.api.generation import MAX_TOP_LOGPROBS, Sampling

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_STOP_STRINGS = 16


class StreamOptions(Strict):
    include_usage: bool | None = None


class ToolSpec(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class _SamplingFields(Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        items = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in items if s]

    def sampling(self, max_tokens: int | None) -> Sampling:
        return Sampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
        )

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise APIError(400, "n > 1 is not supported", param="n")


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not value:
            raise ValueError("messages must not be empty")
        for i, msg in enumerate(value):
            role = msg.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise ValueError(
                    f"messages[{i}]: unknown role {role!r}; "
                    f"expected one of {', '.join(sorted(ROLES - {'function'}))}"
                )
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
