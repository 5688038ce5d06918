"""Responses request -> internal chat request: table tests of the pure converter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxserve.api.body import parse_body
from mlxserve.api.errors import APIError
from mlxserve.api.responses.convert import echo_settings, to_turn
from mlxserve.api.responses.protocol import ResponsesRequest
from mlxserve.api.sealed import seal_reasoning
from mlxserve.chat import encode_request
from mlxserve.chat.render import deepseek_request

DATA = Path(__file__).parent / "data"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}
CALL = {
    "type": "function_call",
    "call_id": "call_a",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}


def _req(**body: Any) -> ResponsesRequest:
    body.setdefault("model", "m")
    return parse_body(ResponsesRequest, json.dumps(body).encode())


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "input_text", "text": text}]}


MESSAGE_CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
    ("string input", {"input": "Hi"}, [{"role": "user", "content": "Hi"}]),
    (
        "instructions are a system message first",
        {"input": "Hi", "instructions": "Be brief."},
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ),
    (
        "roles kept; parts become text parts",
        {
            "input": [
                {"type": "message", "role": "developer", "content": "Rules."},
                {"role": "system", "content": [{"type": "input_text", "text": "Sys."}]},
                _user("Hi"),
            ]
        },
        [
            {"role": "developer", "content": "Rules."},
            {"role": "system", "content": [{"type": "text", "text": "Sys."}]},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
    ),
    (
        "reasoning, message and calls fold into one assistant message",
        {
            "input": [
                _user("Weather?"),
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Think."}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                CALL,
                {"type": "function_call_output", "call_id": "call_a", "output": '{"temp": 22}'},
            ]
        },
        [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Checking."}],
                "reasoning_content": "Think.",
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": '{"temp": 22}'},
        ],
    ),
    (
        "encrypted reasoning alone is decoded back to its text",
        {
            "input": [
                _user("Q"),
                {
                    "type": "reasoning",
                    "summary": [],
                    "encrypted_content": seal_reasoning("Deep\nthought ü"),
                },
                {"type": "message", "role": "assistant", "content": "A"},
                _user("Q2"),
            ]
        },
        [
            {"role": "user", "content": [{"type": "text", "text": "Q"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "A"}],
                "reasoning_content": "Deep\nthought ü",
            },
            {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
        ],
    ),
    (
        "someone else's encrypted reasoning is left out",
        {
            "input": [
                _user("Q"),
                {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-openai"},
                {"type": "message", "role": "assistant", "content": "A"},
                _user("Q2"),
            ]
        },
        [
            {"role": "user", "content": [{"type": "text", "text": "Q"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "A"}],
                "reasoning_content": "",
            },
            {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
        ],
    ),
    (
        "parallel calls share one assistant message; outputs as tool messages; namespace joined",
        {
            "input": [
                _user("Go"),
                CALL,
                {**CALL, "call_id": "call_b", "namespace": "multi_agent_v1", "name": "spawn_agent"},
                {
                    "type": "function_call_output",
                    "call_id": "call_a",
                    "output": [{"type": "input_text", "text": "ok"}],
                },
                {"type": "function_call_output", "call_id": "call_b", "output": "done"},
            ]
        },
        [
            {"role": "user", "content": [{"type": "text", "text": "Go"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {
                        "id": "call_b",
                        "type": "function",
                        "function": {
                            "name": "multi_agent_v1.spawn_agent",
                            "arguments": '{"city": "Paris"}',
                        },
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": [{"type": "text", "text": "ok"}]},
            {"role": "tool", "tool_call_id": "call_b", "content": "done"},
        ],
    ),
    (
        "a second assistant message starts a new assistant turn",
        {
            "input": [
                _user("Q"),
                {"role": "assistant", "content": "A1"},
                {"role": "assistant", "content": "A2"},
                _user("Q2"),
            ]
        },
        [
            {"role": "user", "content": [{"type": "text", "text": "Q"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A1"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A2"}]},
            {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
        ],
    ),
]


@pytest.mark.parametrize(
    ("name", "body", "expected"), MESSAGE_CASES, ids=[c[0] for c in MESSAGE_CASES]
)
def test_input_items_to_chat_messages(name: str, body: dict[str, Any], expected: list[Any]) -> None:
    turn = to_turn(_req(**body))
    assert list(turn.generation.prompt.messages) == expected


def test_previous_items_come_first_and_are_kept() -> None:
    history = ({"type": "message", "role": "user", "content": "Q"}, CALL)
    turn = to_turn(
        _req(input=[{"type": "function_call_output", "call_id": "call_a", "output": "22"}]),
        history,
    )
    assert [m["role"] for m in turn.generation.prompt.messages] == ["user", "assistant", "tool"]
    assert turn.items[:2] == history and turn.items[2]["type"] == "function_call_output"


SETTINGS_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("defaults", {}, {"effort": None, "kwargs": {}, "tools_enabled": True, "parallel": True}),
    (
        "effort none is chat mode",
        {"reasoning": {"effort": "none"}},
        {"effort": "none", "kwargs": {"thinking": False, "enable_thinking": False}},
    ),
    (
        "medium is the model default",
        {"reasoning": {"effort": "medium", "summary": "auto"}},
        {"effort": None},
    ),
    ("minimal is low", {"reasoning": {"effort": "minimal"}}, {"effort": "low"}),
    ("high", {"reasoning": {"effort": "high"}}, {"effort": "high"}),
    ("xhigh", {"reasoning": {"effort": "xhigh"}}, {"effort": "xhigh"}),
    ("tool_choice none", {"tool_choice": "none"}, {"tools_enabled": False}),
    (
        "tool_choice required is served like auto",
        {"tool_choice": "required"},
        {"tools_enabled": True},
    ),
    (
        "named function",
        {"tool_choice": {"type": "function", "name": "get_weather"}},
        {"tools_enabled": True},
    ),
    ("parallel off", {"parallel_tool_calls": False}, {"parallel": False}),
    (
        "sampling",
        {"max_output_tokens": 7, "temperature": 0, "top_p": 0.5},
        {"max_tokens": 7, "temperature": 0.0, "top_p": 0.5},
    ),
    (
        "logprobs included",
        {"include": ["message.output_text.logprobs"], "top_logprobs": 3},
        {"logprobs": True, "top_logprobs": 3},
    ),
    ("top_logprobs alone asks for none", {"top_logprobs": 3}, {"logprobs": False}),
]


@pytest.mark.parametrize(
    ("name", "extra", "expected"), SETTINGS_CASES, ids=[c[0] for c in SETTINGS_CASES]
)
def test_request_settings(name: str, extra: dict[str, Any], expected: dict[str, Any]) -> None:
    gen = to_turn(_req(input="Hi", tools=[WEATHER], **extra)).generation
    got = {
        "effort": gen.prompt.reasoning_effort,
        "kwargs": dict(gen.prompt.chat_template_kwargs),
        "tools_enabled": gen.tools_enabled,
        "parallel": gen.parallel_tool_calls,
        "max_tokens": gen.sampling.max_tokens,
        "temperature": gen.sampling.temperature,
        "top_p": gen.sampling.top_p,
        "logprobs": gen.sampling.logprobs,
        "top_logprobs": gen.sampling.top_logprobs,
    }
    assert {k: got[k] for k in expected} == expected
    assert not gen.sampling.clamp_max_tokens


def test_tools_namespaces_flatten_and_hosted_tools_are_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    namespace = {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Sub-agents.",
        "tools": [
            {
                "type": "function",
                "name": "spawn_agent",
                "parameters": {"type": "object", "properties": {}},
            }
        ],
    }
    hosted = {"type": "web_search", "external_web_access": False}
    turn = to_turn(_req(input="Hi", tools=[WEATHER, namespace, hosted]))
    tools = turn.generation.prompt.tools
    assert tools is not None
    assert [t["function"]["name"] for t in tools] == ["get_weather", "multi_agent_v1.spawn_agent"]
    assert tools[0]["function"] == {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": WEATHER["parameters"],
        "strict": False,
    }
    assert turn.namespaces == {"multi_agent_v1.spawn_agent": ("multi_agent_v1", "spawn_agent")}


def test_only_hosted_tools_means_no_tool_parsing() -> None:
    gen = to_turn(_req(input="Hi", tools=[{"type": "web_search"}])).generation
    assert gen.prompt.tools is None and not gen.tools_enabled


def test_text_format_asks_in_the_system_message_and_constrains() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    gen = to_turn(_req(input="Hi", instructions="Sys.", text={"format": fmt})).generation
    first = gen.prompt.messages[0]
    assert first["role"] == "system" and first["content"] == "Sys."
    assert first["response_format"] == schema
    assert gen.constraint is not None and gen.constraint.json_schema == schema
    gen = to_turn(_req(input="Hi", text={"format": {"type": "json_object"}})).generation
    assert gen.prompt.messages[0] == {
        "role": "system",
        "content": "",
        "response_format": {"type": "json_object"},
    }
    assert gen.constraint is not None and gen.constraint.json_schema == {"type": "object"}
    gen = to_turn(_req(input="Hi", text={"format": {"type": "text"}})).generation
    assert gen.prompt.messages == [{"role": "user", "content": "Hi"}]
    assert gen.constraint is None


def test_forced_tool_choice_constrains_the_calls() -> None:
    other = {**WEATHER, "name": "other"}
    gen = to_turn(_req(input="Hi", tools=[WEATHER, other], tool_choice="required")).generation
    assert gen.constraint is not None
    assert [f["name"] for f in gen.constraint.tools] == ["get_weather", "other"]
    named = {"type": "function", "name": "other"}
    gen = to_turn(
        _req(input="Hi", tools=[WEATHER, other], tool_choice=named, parallel_tool_calls=False)
    ).generation
    assert gen.constraint is not None and not gen.constraint.parallel
    assert [f["name"] for f in gen.constraint.tools] == ["other"]
    assert to_turn(_req(input="Hi", tools=[WEATHER])).generation.constraint is None


BAD_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("unknown item type", {"input": [{"type": "telepathy"}]}, "input[0].type"),
    (
        "function_call_output without its call",
        {
            "input": [
                _user("Q"),
                {"type": "function_call_output", "call_id": "call_x", "output": "1"},
            ]
        },
        "input[1].call_id",
    ),
    (
        "image by file_id",
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
        "input[0].content[0]",
    ),
    (
        "image in an assistant message",
        {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
    ),
    (
        "file part",
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input[0].content[0]",
    ),
    ("unknown role", {"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ("content of a wrong type", {"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    (
        "call without call_id",
        {"input": [_user("Q"), {"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[1].call_id",
    ),
    (
        "arguments not a string",
        {"input": [_user("Q"), {**CALL, "arguments": {"city": "P"}}]},
        "input[1].arguments",
    ),
    ("item_reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ("no conversation", {"input": [], "instructions": "Sys."}, "input"),
    (
        "tool_choice names a hosted tool",
        {"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "web_search"}},
        "tool_choice",
    ),
    (
        "tool_choice names a missing function",
        {"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice",
    ),
    (
        "tool_choice required without tools",
        {"input": "Hi", "tool_choice": "required"},
        "tool_choice",
    ),
    ("bad function name", {"input": "Hi", "tools": [{**WEATHER, "name": "has space"}]}, "tools[0]"),
    (
        "parameters not an object schema",
        {"input": "Hi", "tools": [{**WEATHER, "parameters": {"type": "array"}}]},
        "tools[0]",
    ),
    ("duplicate names", {"input": "Hi", "tools": [WEATHER, WEATHER]}, "tools"),
    ("unknown effort", {"input": "Hi", "reasoning": {"effort": "ludicrous"}}, "reasoning.effort"),
    ("unknown text format", {"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    (
        "json_schema without a schema",
        {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
        "text.format",
    ),
]


@pytest.mark.parametrize(("name", "body", "param"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_requests_are_400_naming_the_field(name: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        to_turn(_req(**body))
    assert info.value.status == 400
    assert info.value.param == param, info.value.message


SCHEMA_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("max_output_tokens as a string", {"max_output_tokens": "8"}, "max_output_tokens"),
    ("max_output_tokens zero", {"max_output_tokens": 0}, "max_output_tokens"),
    ("temperature as a string", {"temperature": "0.5"}, "temperature"),
    ("stream as an int", {"stream": 1}, "stream"),
    ("input as a number", {"input": 3}, "input"),
    ("unknown tool_choice mode", {"tool_choice": "sometimes"}, "tool_choice"),
    ("truncation value", {"truncation": "middle"}, "truncation"),
]


@pytest.mark.parametrize(("name", "extra", "param"), SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES])
def test_schema_types_are_strict(name: str, extra: dict[str, Any], param: str | None) -> None:
    body = {"model": "m", "input": "Hi", **extra}
    with pytest.raises(APIError) as info:
        parse_body(ResponsesRequest, json.dumps(body).encode())
    assert info.value.status == 400 and info.value.param == param


def test_unknown_fields_are_tolerated_and_settings_echoed() -> None:
    req = _req(
        input="Hi",
        client_metadata={"x": "y"},
        prompt_cache_key="k",
        store=False,
        include=["reasoning.encrypted_content"],
        tools=[WEATHER],
    )
    assert req.include_encrypted and not req.stores
    echo = echo_settings(req)
    assert echo["store"] is False and echo["prompt_cache_key"] == "k"
    assert echo["tool_choice"] == "auto" and echo["tools"] == [WEATHER]
    assert echo["temperature"] == 1.0 and echo["text"] == {"format": {"type": "text"}}
    assert _req(input="Hi").stores  # store defaults to true, as in the API


def _golden(case_id: str) -> dict[str, Any]:
    for line in (DATA / "dsv4_encoder_public.jsonl").read_text(encoding="utf-8").splitlines():
        case = json.loads(line)
        if case["id"] == case_id:
            return dict(case)
    raise KeyError(case_id)


def test_golden_tool_round_trip_renders_byte_exact() -> None:
    """enc-pub-0012 sent as Responses items renders the encoder golden exactly."""
    case = _golden("enc-pub-0012")
    req = case["request"]
    system, user, assistant, tool = req["messages"]
    call = assistant["tool_calls"][0]
    fn = req["tools"][0]["function"]
    body = {
        "instructions": system["content"],
        "input": [
            {"role": "user", "content": user["content"]},
            {
                "type": "reasoning",
                "summary": [],
                "encrypted_content": seal_reasoning(assistant["reasoning_content"]),
            },
            {
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            },
            {
                "type": "function_call_output",
                "call_id": tool["tool_call_id"],
                "output": tool["content"],
            },
        ],
        "tools": [{"type": "function", **fn}],
        "reasoning": {"effort": req["reasoning_effort"], "summary": "auto"},
    }
    prompt = to_turn(_req(**body)).generation.prompt
    assert encode_request(deepseek_request(prompt), "v4") == case["prompt"]
