"""Request schemas of the OpenAI-compatible API (pydantic v2, strict types).

Bodies are validated from raw JSON bytes (`parse_body`), so a wrong type
("0.5" for a float, 1 for a bool) is a 400, not a silent coercion. Unknown
fields are accepted and ignored: OpenAI clients send fields this server does
not implement (`store`, `metadata`, ...). Fields that would change the
meaning of the answer and are not implemented are refused with a clear 400.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from mlxserve.api.errors import APIError
from mlxserve.api.generation import ChatGeneration, Sampling
from mlxserve.api.structured import OutputConstraint, forced_calls, strict_calls
from mlxserve.chat import PromptRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_STOP_STRINGS = 16
M = TypeVar("M", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class FunctionSpec(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _TOOL_NAME.match(value):
            raise ValueError("function name must be 1-128 characters of [A-Za-z0-9_.:-]")
        return value

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        kind = value.get("type", "object")
        if kind != "object":
            raise ValueError("function parameters must be a JSON schema of type 'object'")
        props = value.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError("function parameters 'properties' must be an object")
        required = value.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("function parameters 'required' must be a list of strings")
        return value


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _SamplingFields(_Strict):
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
    top_logprobs: int | None = None
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
        self.output_constraint()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def _forced_calls(self) -> OutputConstraint | None:
        """The calls `tool_choice` forces (None for auto/none); 400 when none can be made."""
        choice = self.tool_choice
        if choice != "required" and not isinstance(choice, NamedToolChoice):
            return None
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        forced = forced_calls(self.tool_dicts(), name, self.parallel_tool_calls is not False)
        if forced.tools:
            return forced
        if name is None:
            raise APIError(
                400, "tool_choice forces a tool call but no tools are given", param="tool_choice"
            )
        raise APIError(
            400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )

    def _response_schema(self) -> dict[str, Any] | None:
        fmt = self.response_format
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind != "json_schema":
            raise APIError(
                400,
                f"response_format type {kind!r} is not one of text, json_object, json_schema",
                param="response_format",
            )
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format json_schema needs json_schema.schema, a JSON schema object",
                param="response_format",
            )
        return schema

    def output_constraint(self) -> OutputConstraint | None:
        """What the answer is forced to be (tool_choice required/named, response_format)."""
        forced = self._forced_calls()
        schema = self._response_schema()
        if forced is not None and schema is not None:
            raise APIError(
                400,
                "a forced tool_choice and a JSON response_format exclude each other",
                param="tool_choice",
            )
        if forced is not None:
            return forced
        if schema is not None:
            return OutputConstraint(json_schema=schema)
        if self.tools_enabled and self.tool_choice in (None, "auto"):
            return strict_calls(self.tool_dicts(), self.parallel_tool_calls is not False)
        return None

    @property
    def effective_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def to_generation(self) -> ChatGeneration:
        """This request in the server's internal terms."""
        prompt = PromptRequest(
            messages=self.messages,
            tools=self.tool_dicts(),
            reasoning_effort=self.reasoning_effort,
            chat_template_kwargs=self.chat_template_kwargs or {},
        )
        sampling = replace(
            self.sampling(self.effective_max_tokens),
            logprobs=bool(self.logprobs),
            top_logprobs=self.top_logprobs or 0,
        )
        return ChatGeneration(
            prompt=prompt,
            sampling=sampling,
            stops=tuple(self.stop_strings()),
            tools_enabled=self.tools_enabled,
            parallel_tool_calls=self.parallel_tool_calls is not False,
            stream=bool(self.stream),
            constraint=self.output_constraint(),
        )


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
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise APIError(400, "logprobs must be in [0, 20]", param="logprobs")

    def to_sampling(self) -> Sampling:
        return replace(
            self.sampling(self.max_tokens),
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            prompt_param="prompt",
        )

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of prompts is refused)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [int(x) for x in p]  # type: ignore[arg-type]
        if len(p) == 1:
            first = p[0]
            return first if isinstance(first, str) else [int(x) for x in first]  # type: ignore[union-attr]
        raise APIError(400, "a batch of several prompts is not supported", param="prompt")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_type_tag(item: str) -> bool:
    """pydantic names the union member in `loc` (`str`, `list[int]`, `NamedToolChoice`)."""
    return "[" in item or item in _TYPE_TAGS or item[:1].isupper()


def _loc(loc: tuple[Any, ...]) -> tuple[str | None, bool]:
    """The field path as the client wrote it, and whether a union member was named."""
    parts: list[str] = []
    union = False
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and _is_type_tag(item):
            union = True
        else:
            parts.append(("." if parts else "") + str(item))
    return ("".join(parts) or None), union


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a JSON body; every failure is an `APIError` 400 naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"malformed JSON body: {first['msg']}") from e
        param, union = _loc(tuple(first["loc"]))
        msg = str(first["msg"]).removeprefix("Value error, ")
        if union and first["type"].endswith("_type"):
            msg = f"a value of type {type(first.get('input')).__name__} is not accepted here"
        where = f"{param}: " if param else ""
        raise APIError(400, f"{where}{msg}", param=param) from e
