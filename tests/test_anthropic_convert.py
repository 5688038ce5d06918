"""Table tests of the Anthropic conversions (pure functions, no server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxserve.api.anthropic.convert import (
    openai_messages,
    prompt_request,
    to_generation,
)
from mlxserve.api.anthropic.events import MessageEvents, MessageMeta, stop_reason
from mlxserve.api.anthropic.protocol import MessagesRequest
from mlxserve.api.errors import APIError
from mlxserve.api.pipeline import Accumulator, OutputDelta, ToolCallDelta, Usage
from mlxserve.api.sealed import seal_reasoning, unseal_reasoning
from mlxserve.api.writer import RunEnd


def _req(**fields: Any) -> MessagesRequest:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(fields)
    return MessagesRequest.model_validate_json(json.dumps(body))


TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "text of a"}

MESSAGE_CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
    (
        "string system",
        {"system": "Be brief."},
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    ),
    (
        "system blocks stay blocks (the encoder joins them)",
        {"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        [
            {
                "role": "system",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "user", "content": "hi"},
        ],
    ),
    (
        "a system message after the first turn is a developer turn where it stands",
        {
            "messages": [
                {"role": "system", "content": "first"},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "env"},
            ]
        },
        [
            {"role": "system", "content": [{"type": "text", "text": "first"}]},
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": [{"type": "text", "text": "env"}]},
        ],
    ),
    (
        "tool_use and tool_result become a call and a tool message, text after it a user turn",
        {
            "messages": [
                {"role": "user", "content": "read a"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "I'll read.", "signature": "x"},
                        {"type": "text", "text": "Reading."},
                        TOOL_USE,
                    ],
                },
                {"role": "user", "content": [RESULT, {"type": "text", "text": "now b"}]},
            ]
        },
        [
            {"role": "user", "content": "read a"},
            {
                "role": "assistant",
                "content": "Reading.",
                "reasoning_content": "I'll read.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "read", "arguments": {"path": "a"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "text of a"},
            {"role": "user", "content": [{"type": "text", "text": "now b"}]},
        ],
    ),
    (
        "tool_result content blocks are joined; redacted thinking renders nothing",
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [{"type": "redacted_thinking", "data": "opaque"}, TOOL_USE],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            **RESULT,
                            "is_error": True,
                            "content": [
                                {"type": "text", "text": "line 1"},
                                {"type": "text", "text": "line 2"},
                            ],
                        }
                    ],
                },
            ]
        },
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "read", "arguments": {"path": "a"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "line 1\nline 2"},
        ],
    ),
]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [(f, e) for _, f, e in MESSAGE_CASES],
    ids=[i for i, _, _ in MESSAGE_CASES],
)
def test_openai_messages(fields: dict[str, Any], expected: list[dict[str, Any]]) -> None:
    assert openai_messages(_req(**fields)) == expected


def test_empty_thinking_text_comes_back_from_its_signature() -> None:
    signature = seal_reasoning("secret reasoning ✓")
    thinking = {"type": "thinking", "thinking": "", "signature": signature}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [thinking, {"type": "text", "text": "ok"}]},
        {"role": "user", "content": "more"},
    ]
    converted = openai_messages(_req(messages=messages))
    assert converted[1]["reasoning_content"] == "secret reasoning ✓"


@pytest.mark.parametrize(
    "signature", ["", "EqQBCkYIARgCIkB", "mlxserve-v1.!!!", "mlxserve-v1.aGVsbG8="]
)
def test_foreign_or_broken_signatures_decode_to_nothing(signature: str) -> None:
    assert unseal_reasoning(signature) is None


EFFORT_CASES: list[tuple[dict[str, Any], dict[str, Any], Any]] = [
    ({}, {}, None),
    ({"thinking": {"type": "disabled"}}, {"thinking": False, "enable_thinking": False}, None),
    ({"thinking": {"type": "adaptive"}}, {"thinking": True, "enable_thinking": True}, None),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"thinking": True, "enable_thinking": True},
        "low",
    ),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 8192}},
        {"thinking": True, "enable_thinking": True},
        "high",
    ),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 64000}},
        {"thinking": True, "enable_thinking": True},
        "max",
    ),
    (
        {
            "thinking": {"type": "enabled", "budget_tokens": 64000},
            "output_config": {"effort": "medium"},
        },
        {"thinking": True, "enable_thinking": True},
        "medium",
    ),
    ({"output_config": {"effort": "max"}}, {}, "max"),
]


@pytest.mark.parametrize(("fields", "kwargs", "effort"), EFFORT_CASES)
def test_thinking_and_effort(fields: dict[str, Any], kwargs: dict[str, Any], effort: Any) -> None:
    prompt = prompt_request(_req(**fields))
    assert dict(prompt.chat_template_kwargs) == kwargs
    assert prompt.reasoning_effort == effort


def test_tools_become_functions_and_server_tools_are_left_out() -> None:
    tools = [
        {"name": "Read", "description": "read a file", "input_schema": {"type": "object"}},
        {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
    ]
    prompt = prompt_request(_req(tools=tools))
    assert prompt.tools == [
        {
            "type": "function",
            "function": {
                "name": "Read",
                "description": "read a file",
                "parameters": {"type": "object"},
            },
        },
        {"type": "function", "function": {"name": "Later", "parameters": {"type": "object"}}},
    ]


def test_generation_settings() -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    gen = to_generation(
        _req(
            tools=tools,
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            stop_sequences=["END", ""],
            temperature=0.5,
            top_k=5,
            stream=True,
        )
    )
    assert gen.tools_enabled and not gen.parallel_tool_calls and gen.stream
    assert gen.stops == ("END",)
    assert gen.sampling.max_tokens == 64 and gen.sampling.clamp_max_tokens
    assert gen.sampling.temperature == 0.5 and gen.sampling.top_k == 5
    assert not to_generation(_req(tools=tools, tool_choice={"type": "none"})).tools_enabled
    assert not to_generation(_req()).tools_enabled


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": [{"role": "user", "content": []}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "user", "content": [RESULT]}]},
        {"tool_choice": {"type": "any"}},
    ],
)
def test_conversion_refuses(fields: dict[str, Any]) -> None:
    with pytest.raises(APIError) as info:
        to_generation(_req(**fields))
    assert info.value.status == 400


META = MessageMeta(id="msg_1", model="m")


def _names(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    out = []
    for name, data in events:
        if name == "content_block_delta":
            out.append(data["delta"]["type"])
        elif name == "content_block_start":
            out.append("start:" + data["content_block"]["type"])
        else:
            out.append(name)
    return out


def test_event_order_for_reasoning_then_a_tool_call() -> None:
    writer = MessageEvents(META)
    events = writer.start(Usage(prompt_tokens=10))
    events += writer.delta(OutputDelta(reasoning="Let me "))
    events += writer.delta(OutputDelta(reasoning="check."))
    events += writer.delta(OutputDelta(content="\n\n"))
    events += writer.delta(OutputDelta(tool_calls=[ToolCallDelta(0, "call_9", "read", "")]))
    events += writer.delta(OutputDelta(tool_calls=[ToolCallDelta(0, arguments='{"path"')]))
    events += writer.delta(OutputDelta(tool_calls=[ToolCallDelta(0, arguments=': "a"}')]))
    events += writer.finish(
        RunEnd("tool_calls", None, Usage(prompt_tokens=10, completion_tokens=7, cached_tokens=4))
    )
    assert _names(events) == [
        "message_start",
        "ping",
        "start:thinking",
        "thinking_delta",
        "thinking_delta",
        "signature_delta",
        "content_block_stop",
        "start:tool_use",
        "input_json_delta",
        "input_json_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    signature = next(
        d["delta"]["signature"]
        for n, d in events
        if d.get("delta", {}).get("type") == "signature_delta"
    )
    assert unseal_reasoning(signature) == "Let me check."
    tool_start = next(d for n, d in events if n == "content_block_start" and d["index"] == 1)
    assert tool_start["content_block"]["id"] == "toolu_9"
    final = next(d for n, d in events if n == "message_delta")
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"] == {
        "input_tokens": 6,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 7,
    }


def test_text_blocks_and_whitespace() -> None:
    writer = MessageEvents(META)
    events = writer.delta(OutputDelta(content=" "))
    assert events == []  # whitespace waits: it may be what separates a tool call
    events = writer.delta(OutputDelta(content="Hi"))
    assert [d["delta"]["text"] for n, d in events if n == "content_block_delta"] == [" Hi"]
    # An answer of only whitespace is still sent, not dropped.
    spaces = MessageEvents(META)
    spaces.delta(OutputDelta(content="\n"))
    tail = spaces.finish(RunEnd("stop", None, Usage()))
    assert [d["delta"]["text"] for n, d in tail if n == "content_block_delta"] == ["\n"]


def test_empty_output_still_has_one_block_and_hidden_thinking_sends_no_text() -> None:
    writer = MessageEvents(META)
    assert _names(writer.finish(RunEnd("length", None, Usage()))) == [
        "start:text",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    hidden = MessageEvents(MessageMeta(id="msg_2", model="m", show_thinking=False))
    names = _names(
        hidden.delta(OutputDelta(reasoning="secret")) + hidden.finish(RunEnd("stop", None, Usage()))
    )
    assert "thinking_delta" not in names and "signature_delta" in names


@pytest.mark.parametrize(
    ("finish", "stop", "expected"),
    [
        ("stop", None, "end_turn"),
        ("length", None, "max_tokens"),
        ("tool_calls", None, "tool_use"),
        ("stop", "END", "stop_sequence"),
        (None, None, "end_turn"),
    ],
)
def test_stop_reasons(finish: str | None, stop: str | None, expected: str) -> None:
    assert stop_reason(finish, stop) == expected


def _message_body(
    meta: MessageMeta, acc: Accumulator, usage: Usage, stop: str | None
) -> dict[str, Any]:
    return MessageEvents(meta).body(acc, RunEnd(acc.finish_reason or "stop", stop, usage))


def test_message_body_matches_the_stream() -> None:
    acc = Accumulator()
    deltas = [
        OutputDelta(reasoning="Think."),
        OutputDelta(content="\n\n"),
        OutputDelta(tool_calls=[ToolCallDelta(0, "call_1", "read", '{"path": "a"}')]),
        OutputDelta(finish_reason="tool_calls"),
    ]
    for delta in deltas:
        acc.add(delta)
    body = _message_body(META, acc, Usage(prompt_tokens=3, completion_tokens=5), None)
    assert [b["type"] for b in body["content"]] == ["thinking", "tool_use"]
    assert body["content"][1] == {
        "type": "tool_use",
        "id": "toolu_1",
        "name": "read",
        "input": {"path": "a"},
    }
    assert body["stop_reason"] == "tool_use"
    hidden = _message_body(MessageMeta("msg_1", "m", show_thinking=False), acc, Usage(), None)
    assert hidden["content"][0]["thinking"] == ""
    assert unseal_reasoning(hidden["content"][0]["signature"]) == "Think."


def _folded(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks a client builds from the stream events."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text)
    return blocks


def test_message_body_keeps_the_order_of_text_and_tool_calls() -> None:
    """Text between and after calls stays where the model put it, as in the stream."""
    deltas = [
        OutputDelta(reasoning="Plan."),
        OutputDelta(content="First I read."),
        OutputDelta(tool_calls=[ToolCallDelta(0, "call_1", "read", "")]),
        OutputDelta(tool_calls=[ToolCallDelta(0, arguments='{"path": "a"}')]),
        OutputDelta(content="Then "),
        OutputDelta(content="I write."),
        OutputDelta(tool_calls=[ToolCallDelta(1, "call_2", "write", '{"path": "b"}')]),
        OutputDelta(content="Both sent."),
        OutputDelta(finish_reason="tool_calls"),
    ]
    writer = MessageEvents(META)
    events = writer.start(Usage())
    acc = Accumulator()
    for delta in deltas:
        events += writer.delta(delta)
        acc.add(delta)
    events += writer.finish(RunEnd("tool_calls", None, Usage()))
    body = _message_body(META, acc, Usage(), None)
    kinds = ["thinking", "text", "tool_use", "text", "tool_use", "text"]
    assert [b["type"] for b in body["content"]] == kinds
    assert body["content"] == _folded(events)


def test_a_discarded_call_leaves_the_message_and_its_text_joins() -> None:
    acc = Accumulator()
    for delta in [
        OutputDelta(content="Reading. "),
        OutputDelta(tool_calls=[ToolCallDelta(0, "call_1", "read", '{"pa')]),
        OutputDelta(content="<broken call>", discarded=[0]),
        OutputDelta(finish_reason="stop"),
    ]:
        acc.add(delta)
    body = _message_body(META, acc, Usage(), None)
    assert body["content"] == [{"type": "text", "text": "Reading. <broken call>"}]


def test_v41_takes_client_effort_names() -> None:
    from mlxserve.chat import PromptRequest, render_text
    from mlxserve.models.tiny.scripted import scripted_model

    model = scripted_model("x", model_type="deepseek_v41", chat_encoder="deepseek_v41")
    messages = [{"role": "user", "content": "hi"}]
    medium = render_text(model, PromptRequest(messages=messages, reasoning_effort="medium"))
    low = render_text(model, PromptRequest(messages=messages, reasoning_effort="low"))
    assert medium == low and "Reasoning Effort: 25" in low


class _FakeRun:
    """What `stream_run` reads of a GenerationRun: its pipeline's usage and its deltas."""

    def __init__(self, deltas: list[OutputDelta], wait_s: float = 0.0, fail: bool = False) -> None:
        from types import SimpleNamespace

        self.pipeline = SimpleNamespace(usage=Usage(prompt_tokens=5), stop_string=None)
        self._deltas = deltas
        self._wait_s = wait_s
        self._fail = fail
        self.failures: list[str] = []  # what the status page would list

    def report_failure(self, message: str) -> None:
        self.failures.append(message)

    async def deltas(self) -> Any:
        import asyncio

        from mlxserve.api.pipeline import EngineRequestFailed

        await asyncio.sleep(self._wait_s)  # a long prefill
        for delta in self._deltas:
            yield delta
        if self._fail:
            raise EngineRequestFailed("the step failed")


def _stream_names(run: _FakeRun, keepalive_s: float) -> list[str]:
    import asyncio

    from mlxserve.api.writer import stream_run

    async def main() -> list[bytes]:
        return [chunk async for chunk in stream_run(run, MessageEvents(META), keepalive_s)]  # type: ignore[arg-type]

    chunks = asyncio.run(main())
    return [c.decode().split("\n", 1)[0].removeprefix("event: ") for c in chunks]


def test_pings_while_the_prompt_prefills() -> None:
    names = _stream_names(
        _FakeRun([OutputDelta(content="Hi", finish_reason="stop")], wait_s=0.2), 0.02
    )
    assert names[:2] == ["message_start", "ping"]
    first_block = names.index("content_block_start")
    assert names[2:first_block].count("ping") >= 2
    assert names[-2:] == ["message_delta", "message_stop"]


def test_a_failure_mid_stream_is_an_error_event() -> None:
    run = _FakeRun([OutputDelta(content="Hi")], fail=True)
    names = _stream_names(run, 10.0)
    assert names[-1] == "error" and "message_stop" not in names
    assert len(run.failures) == 1  # the operator page lists it


def test_billing_header_block_is_left_out_of_the_prompt() -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.b58;"},
        {"type": "text", "text": "You are Claude Code."},
    ]
    assert openai_messages(_req(system=system))[0] == {
        "role": "system",
        "content": [{"type": "text", "text": "You are Claude Code."}],
    }
    only_header = openai_messages(_req(system=system[:1]))
    assert [m["role"] for m in only_header] == ["user"]


def test_output_format_becomes_the_system_response_format() -> None:
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    config = {"effort": "high", "format": {"type": "json_schema", "schema": schema}}
    with_system = openai_messages(_req(system="Title it.", output_config=config))
    assert with_system[0] == {"role": "system", "content": "Title it.", "response_format": schema}
    without = openai_messages(_req(output_config=config))
    assert without[0] == {"role": "system", "content": "", "response_format": schema}


def test_output_format_renders_deepseeks_response_format_section() -> None:
    from mlxserve.chat import render_text
    from mlxserve.models.tiny.scripted import scripted_model

    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    config = {"format": {"type": "json_schema", "schema": schema}}
    text = render_text(
        scripted_model("x"), prompt_request(_req(system="Title it.", output_config=config))
    )
    section = (
        "Title it.\n\n## Response Format:\n\n"
        "You MUST strictly adhere to the following schema to reply:\n" + json.dumps(schema)
    )
    assert section + "<｜User｜>hi" in text
