"""Normalise OpenAI chat messages into typed messages.

The HTTP layer hands us the client's message dicts; everything after this
module works on the dataclasses below. Text-block lists are joined here (the
separator is the caller's: DeepSeek-V4 uses "\\n", V4.1 "\\n\\n"), assistant
tool-call arguments are decoded once (a JSON string and an already-decoded
object give the same `ToolCall`), and `tool` messages stay tool messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mlxserve.chat.errors import PromptError
from mlxserve.chat.images import ImageInput, ImagePart

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCall:
    """One assistant tool call.

    `arguments` is the decoded JSON object, or None when the client sent a
    string that is not a JSON object (then `arguments_text` holds it and only
    a lenient encoder, DeepSeek-V4.1, renders it). An empty or null
    argument string decodes to `{}` (strict; V4.1 renders null as a value);
    see `decode_arguments`.
    """

    name: str
    arguments: dict[str, Any] | None
    id: str | None = None
    arguments_text: str | None = None


@dataclass(frozen=True)
class SystemMessage:
    content: str
    response_format: dict[str, Any] | None = None
    role: Literal["system"] = "system"


@dataclass(frozen=True)
class DeveloperMessage:
    content: str
    response_format: dict[str, Any] | None = None
    role: Literal["developer"] = "developer"


@dataclass(frozen=True)
class UserMessage:
    content: str
    name: str | None = None
    role: Literal["user"] = "user"


@dataclass(frozen=True)
class AssistantMessage:
    """`content` is None when the client sent null (DeepSeek renders it as "")."""

    content: str | None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    role: Literal["assistant"] = "assistant"


@dataclass(frozen=True)
class ToolMessage:
    content: str
    tool_call_id: str | None = None
    name: str | None = None
    role: Literal["tool"] = "tool"


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


def normalise_messages(
    raw: Sequence[Mapping[str, Any]],
    *,
    join: str = "\n",
    strict_arguments: bool = True,
) -> list[Message]:
    """Turn OpenAI message dicts into typed messages.

    `join` separates the text blocks of a content list. With
    `strict_arguments`, a tool-call argument string that is not a JSON object
    raises PromptError; without, it is kept in `ToolCall.arguments_text`.
    """
    if not _is_list(raw):
        raise PromptError("'messages' must be a list of message objects")
    return [_normalise_one(i, m, join, strict_arguments) for i, m in enumerate(raw)]


def _is_map(value: Any) -> bool:
    return type(value) is dict or isinstance(value, Mapping)


def _is_list(value: Any) -> bool:
    if type(value) is list:
        return True
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _normalise_one(index: int, msg: Any, join: str, strict: bool) -> Message:
    where = f"messages[{index}]"
    if not _is_map(msg):
        raise PromptError(f"{where} must be an object with a 'role'")
    role = msg.get("role")
    if role not in ROLES:
        raise PromptError(f"{where}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = content_text(msg.get("content"), join, where)
    if role == "assistant":
        return AssistantMessage(
            content=content,
            reasoning=_reasoning(msg, where),
            tool_calls=_tool_calls(msg.get("tool_calls"), where, strict),
        )
    text = content or ""
    if role == "user":
        return UserMessage(text, name=_opt_str(msg, "name", where))
    if role == "tool":
        return ToolMessage(
            text,
            tool_call_id=_opt_str(msg, "tool_call_id", where),
            name=_opt_str(msg, "name", where),
        )
    fmt = msg.get("response_format")
    if fmt is not None and not _is_map(fmt):
        raise PromptError(f"{where}.response_format must be an object")
    fmt_dict = dict(fmt) if fmt is not None else None
    if role == "system":
        return SystemMessage(text, response_format=fmt_dict)
    return DeveloperMessage(text, response_format=fmt_dict)


def content_text(content: Any, join: str, where: str = "message") -> str | None:
    """A message's content as text: a string, None, or a list of text blocks."""
    if content is None or type(content) is str:
        return content
    if isinstance(content, str):
        return str(content)
    if _is_list(content):
        parts: list[str] = []
        for j, block in enumerate(content):
            if isinstance(block, str):
                parts.append(block)
                continue
            if not _is_map(block) and _is_image(block):
                # The api layer replaces every image before rendering (placeholder mode) or
                # refuses it; an image that gets here has no renderer that can place it.
                raise PromptError(f"{where}.content[{j}]: this model's prompt cannot hold images")
            if not _is_map(block) or block.get("type", "text") != "text":
                kind = block.get("type") if _is_map(block) else type(block).__name__
                raise PromptError(
                    f"{where}.content[{j}]: only text blocks are supported, got {kind!r}"
                )
            text = block.get("text")
            if not isinstance(text, str):
                raise PromptError(f"{where}.content[{j}].text must be a string")
            parts.append(text)
        return join.join(parts)
    raise PromptError(f"{where}.content must be a string, null or a list of text blocks")


def _is_image(block: Any) -> bool:
    return isinstance(block, ImageInput | ImagePart)


def _reasoning(msg: Mapping[str, Any], where: str) -> str | None:
    value = msg.get("reasoning_content")
    if value is None:
        value = msg.get("reasoning")
    if value is not None and not isinstance(value, str):
        raise PromptError(f"{where}.reasoning_content must be a string")
    return value


def _opt_str(obj: Mapping[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise PromptError(f"{where}.{key} must be a string")
    return value


def _tool_calls(raw: Any, where: str, strict: bool) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not _is_list(raw):
        raise PromptError(f"{where}.tool_calls must be a list")
    calls: list[ToolCall] = []
    for j, call in enumerate(raw):
        here = f"{where}.tool_calls[{j}]"
        if not _is_map(call):
            raise PromptError(f"{here} must be an object")
        fn = call.get("function", call)
        if not _is_map(fn):
            raise PromptError(f"{here}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise PromptError(f"{here}.function.name must be a non-empty string")
        # A call without `arguments` has none ({}); an explicit null is a value (V4.1).
        raw_args = fn.get("arguments", {})
        args, text = decode_arguments(raw_args, f"{here}.function.arguments", strict)
        calls.append(ToolCall(name, args, _opt_str(call, "id", here), text))
    return tuple(calls)


def decode_arguments(
    value: Any, where: str = "arguments", strict: bool = True
) -> tuple[dict[str, Any] | None, str | None]:
    """Decode tool-call arguments: (object, original text if it was a string).

    When `strict` (DeepSeek-V4, templates), None means `{}` and so does a
    blank string; a string that is not a JSON object raises PromptError.
    Lenient (the DeepSeek-V4.1 rule) gives `(None, text)` for such a string,
    except that it decodes a JSON string once more, so a double-encoded object
    is still that object; a value that is neither a string nor an object,
    JSON null included (V4.1's wrapper does not turn it into `{}` as V4's
    does), becomes the single argument `{"arguments": value}`.
    """
    if value is None and strict:
        return {}, None
    if _is_map(value):
        return dict(value), None
    if not isinstance(value, str):
        if strict:
            raise PromptError(f"{where} must be a JSON object or a string holding one")
        return {"arguments": value}, None
    if strict and not value.strip():
        return {}, value
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError as e:
        if strict:
            raise PromptError(f"{where} is not valid JSON ({e.msg} at char {e.pos})") from e
        return None, value
    if not strict and isinstance(decoded, str):
        # The V4.1 reference decodes up to twice: '"{\\"a\\": 1}"' is {"a": 1}.
        try:
            decoded = json.loads(decoded)
        except json.JSONDecodeError:
            return None, value
    if not isinstance(decoded, dict):
        if strict:
            raise PromptError(f"{where} must encode a JSON object, got {type(decoded).__name__}")
        return None, value
    return decoded, value
