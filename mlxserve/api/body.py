"""What every dialect's request body shares: strict parsing and the function tool.

Bodies are validated from raw JSON bytes (`parse_body`), so a wrong type
("0.5" for a float, 1 for a bool) is a 400 naming the field, not a silent
coercion. Unknown fields are accepted and ignored: clients send fields this
server does not implement. `FunctionSpec` is a function tool as the prompt
renders it, checked the same way whichever dialect declared it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, field_validator

from mlxserve.api.errors import APIError
from mlxserve.api.generation import MAX_TOP_LOGPROBS

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
M = TypeVar("M", bound=BaseModel)


def _top_logprobs_in_range(value: int | None) -> int | None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    return value


# The `top_logprobs` field of every route that takes one.
TopLogprobs = Annotated[int | None, AfterValidator(_top_logprobs_in_range)]


class Strict(BaseModel):
    """Strict types; unknown fields are kept and ignored."""

    model_config = ConfigDict(strict=True, extra="allow")


class FunctionSpec(Strict):
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
