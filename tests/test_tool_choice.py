"""One `tool_choice` mapping for three dialects: the same choice, spelled three ways,
gives the same constraint, and the same mistakes are the same 400."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxserve.api.anthropic.convert import to_generation
from mlxserve.api.anthropic.protocol import MessagesRequest
from mlxserve.api.body import parse_body
from mlxserve.api.errors import APIError
from mlxserve.api.generation import ChatGeneration
from mlxserve.api.openai.convert import chat_generation
from mlxserve.api.openai.protocol import ChatCompletionRequest
from mlxserve.api.responses.convert import to_turn
from mlxserve.api.responses.protocol import ResponsesRequest
from mlxserve.api.structured import OutputConstraint, ToolChoice, answer_constraint

PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
NAMES = ("read", "write")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}


def _openai(choice: Any, json_format: bool, parallel: bool | None = None) -> ChatGeneration:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"type": "function", "function": {"name": n, "parameters": PARAMS}} for n in NAMES
        ],
    }
    if choice is not None:
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice}} if choice in NAMES else choice
        )
    if json_format:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return chat_generation(parse_body(ChatCompletionRequest, json.dumps(body).encode()))


def _anthropic(choice: Any, json_format: bool, parallel: bool | None = None) -> ChatGeneration:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": n, "input_schema": PARAMS} for n in NAMES],
    }
    if choice is not None:
        spelled = {"required": {"type": "any"}, "auto": {"type": "auto"}, "none": {"type": "none"}}
        body["tool_choice"] = spelled.get(choice, {"type": "tool", "name": choice})
    if parallel is not None:
        body["tool_choice"] = {
            **body.get("tool_choice", {"type": "auto"}),
            "disable_parallel_tool_use": not parallel,
        }
    if json_format:
        body["output_config"] = {"format": {"type": "json_schema", "schema": SCHEMA}}
    return to_generation(parse_body(MessagesRequest, json.dumps(body).encode()))


def _responses(choice: Any, json_format: bool, parallel: bool | None = None) -> ChatGeneration:
    body: dict[str, Any] = {
        "model": "m",
        "input": "hi",
        "tools": [{"type": "function", "name": n, "parameters": PARAMS} for n in NAMES],
    }
    if choice is not None:
        body["tool_choice"] = {"type": "function", "name": choice} if choice in NAMES else choice
    if json_format:
        body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return to_turn(parse_body(ResponsesRequest, json.dumps(body).encode())).generation


DIALECTS = [_openai, _anthropic, _responses]


def _called(constraint: OutputConstraint | None) -> tuple[str, ...] | None:
    if constraint is None:
        return None
    return tuple(str(f["name"]) for f in constraint.tools)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [(None, None), ("auto", None), ("none", None), ("required", NAMES), ("write", ("write",))],
)
@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_same_choice_gives_the_same_constraint(
    dialect: Any, choice: Any, expected: Any
) -> None:
    gen = dialect(choice, json_format=False)
    assert _called(gen.constraint) == expected
    assert gen.tools_enabled == (choice != "none")


@pytest.mark.parametrize(
    ("choice", "parallel", "many"),
    [
        ("write", None, False),  # a named choice is exactly one call, whatever the default
        ("write", True, False),
        ("write", False, False),
        ("required", None, True),  # one or more
        ("required", True, True),
        ("required", False, False),  # exactly one
        ("auto", False, False),
    ],
)
@pytest.mark.parametrize("dialect", DIALECTS)
def test_how_many_calls_the_grammar_and_the_pipeline_admit(
    dialect: Any, choice: str, parallel: bool | None, many: bool
) -> None:
    """The grammar and the output pipeline agree on one call or several."""
    gen = dialect(choice, json_format=False, parallel=parallel)
    assert gen.parallel_tool_calls == many
    if choice != "auto":
        assert gen.constraint is not None and gen.constraint.parallel == many


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_json_format_constrains_the_answer_when_calls_are_not_forced(dialect: Any) -> None:
    constraint = dialect("auto", json_format=True).constraint
    assert constraint is not None and constraint.json_schema is not None
    assert dict(constraint.json_schema)["properties"] == SCHEMA["properties"]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize(("choice", "json_format"), [("nope", False), ("required", True)])
def test_the_same_mistake_is_the_same_400(dialect: Any, choice: str, json_format: bool) -> None:
    with pytest.raises(APIError) as caught:
        dialect(choice, json_format)
    assert caught.value.status == 400 and caught.value.param == "tool_choice"


def test_a_forced_call_without_tools_is_a_400() -> None:
    with pytest.raises(APIError, match="no tools are given"):
        answer_constraint(None, ToolChoice("required", label="any"))


def test_strict_functions_are_enforced_only_when_calls_are_allowed() -> None:
    tools = [{"type": "function", "function": {"name": "f", "strict": True}}]
    optional = answer_constraint(tools, ToolChoice("auto"))
    assert optional is not None and optional.optional
    assert answer_constraint(tools, ToolChoice("none")) is None
