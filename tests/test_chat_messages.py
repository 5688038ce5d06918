"""OpenAI message normalisation into typed messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxserve.chat import (
    AssistantMessage,
    DeveloperMessage,
    PromptError,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
    normalise_messages,
)
from mlxserve.chat.messages import decode_arguments


def _assistant(arguments: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        ],
    }


def test_every_role_becomes_its_dataclass() -> None:
    raw: list[dict[str, Any]] = [
        {"role": "system", "content": "s", "response_format": {"type": "json_object"}},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "u", "name": "bob"},
        _assistant('{"x": 1}'),
        {"role": "tool", "tool_call_id": "c1", "content": "r", "name": "f"},
    ]
    system, developer, user, assistant, tool = normalise_messages(raw)
    assert system == SystemMessage("s", response_format={"type": "json_object"})
    assert developer == DeveloperMessage("d")
    assert user == UserMessage("u", name="bob")
    assert assistant == AssistantMessage(
        None, reasoning="think", tool_calls=(ToolCall("f", {"x": 1}, "c1", '{"x": 1}'),)
    )
    assert tool == ToolMessage("r", tool_call_id="c1", name="f")


def test_content_forms() -> None:
    blocks = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert normalise_messages([{"role": "user", "content": blocks}])[0] == UserMessage("a\nb")
    two = normalise_messages([{"role": "user", "content": blocks}], join="\n\n")
    assert two[0] == UserMessage("a\n\nb")
    assert normalise_messages([{"role": "user", "content": None}])[0] == UserMessage("")
    assert normalise_messages([{"role": "assistant"}])[0] == AssistantMessage(None)
    tool = normalise_messages([{"role": "tool", "content": blocks, "tool_call_id": "x"}])[0]
    assert tool == ToolMessage("a\nb", tool_call_id="x")


def test_reasoning_alias() -> None:
    msg = normalise_messages([{"role": "assistant", "content": "c", "reasoning": "r"}])[0]
    assert isinstance(msg, AssistantMessage) and msg.reasoning == "r"
    both = {"role": "assistant", "reasoning_content": "rc", "reasoning": "r"}
    msg = normalise_messages([both])[0]
    assert isinstance(msg, AssistantMessage) and msg.reasoning == "rc"


def test_string_and_object_arguments_give_the_same_call() -> None:
    args = {"path": "a.py", "n": [1, 2], "deep": {"k": None}}
    from_str = normalise_messages([_assistant(json.dumps(args))])[0]
    from_obj = normalise_messages([_assistant(args)])[0]
    assert isinstance(from_str, AssistantMessage) and isinstance(from_obj, AssistantMessage)
    assert from_str.tool_calls[0].arguments == from_obj.tool_calls[0].arguments == args


@pytest.mark.parametrize("bad", ["{not json", "[1]", "3", "null x"])
def test_invalid_argument_strings(bad: str) -> None:
    with pytest.raises(PromptError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"):
        normalise_messages([_assistant(bad)])
    lenient = normalise_messages([_assistant(bad)], strict_arguments=False)[0]
    assert isinstance(lenient, AssistantMessage)
    assert lenient.tool_calls[0] == ToolCall("f", None, "c1", bad)


def test_blank_arguments() -> None:
    assert decode_arguments(None) == ({}, None)
    assert decode_arguments("") == ({}, "")
    assert decode_arguments("  ", strict=False) == (None, "  ")


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ([{"role": "function", "content": "x"}], "unknown role 'function'"),
        (["hello"], r"messages\[0\] must be an object"),
        ("hello", "must be a list"),
        ([{"role": "user", "content": {"text": "x"}}], "content must be"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\[0\]\.text"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text blocks"),
        ([{"role": "assistant", "tool_calls": {"id": 1}}], "tool_calls must be a list"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "name"),
        ([{"role": "assistant", "reasoning_content": 5}], "reasoning_content"),
        ([{"role": "tool", "content": "x", "tool_call_id": 5}], "tool_call_id"),
        ([{"role": "system", "content": "x", "response_format": "json"}], "response_format"),
    ],
)
def test_malformed_messages(raw: Any, match: str) -> None:
    with pytest.raises(PromptError, match=match):
        normalise_messages(raw)


def test_prompt_error_is_a_value_error() -> None:
    assert issubclass(PromptError, ValueError)


def test_lenient_arguments_follow_the_v41_rule() -> None:
    inner = {"city": "Paris"}
    double = json.dumps(json.dumps(inner))
    assert decode_arguments(double, strict=False) == (inner, double)
    assert decode_arguments('"Paris"', strict=False) == (None, '"Paris"')
    assert decode_arguments(json.dumps("[1]"), strict=False) == (None, json.dumps("[1]"))
    assert decode_arguments([1, 2], strict=False) == ({"arguments": [1, 2]}, None)
    assert decode_arguments(None, strict=False) == ({"arguments": None}, None)
    with pytest.raises(PromptError, match="must encode a JSON object"):
        decode_arguments(double)
    with pytest.raises(PromptError, match="must be a JSON object"):
        decode_arguments([1, 2])
