"""Tool calling end to end: a scripted DeepSeek-V4 model behind the full server stack.

The scripted model's logits force the DSML text of a golden case (tokenised
with the real DeepSeek-V4 tokenizer); the server runs the real encoder,
engine, detokenizer and DSML/reasoning parsers, and the official `openai`
client reads the result.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from api_fixtures import ServerThread, scripted_server

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"
MODEL = "scripted-v4"
ASSISTANT = "<｜Assistant｜><think>"
EOS = "<｜end▁of▁sentence｜>"


def _jsonl(name: str) -> dict[str, dict[str, Any]]:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return {case["id"]: case for case in map(json.loads, filter(None, lines))}


ENCODER = _jsonl("dsv4_encoder_public.jsonl")
OUTPUTS = _jsonl("dsv4_outputs_public.jsonl")
# A system + user turn with tools, an assistant tool call, then its tool result.
ROUND_TRIP = ENCODER["enc-pub-0012"]
# Reasoning that hands off straight to two parallel tool calls.
PARALLEL = OUTPUTS["out-pub-0004"]


def _assistant_reply(case: dict[str, Any]) -> str:
    """The assistant turn the golden prompt renders (what the model said)."""
    prompt = case["prompt"]
    start = prompt.index(ASSISTANT) + len(ASSISTANT)
    return prompt[start : prompt.index(EOS, start)]


def _server(script: str, *extra: str) -> ServerThread:
    return scripted_server(script, *extra, model=MODEL)


@pytest.fixture(scope="module")
def single() -> Iterator[ServerThread]:
    with _server(_assistant_reply(ROUND_TRIP)) as srv:
        yield srv


@pytest.fixture(scope="module")
def parallel() -> Iterator[ServerThread]:
    with _server(PARALLEL["text"]) as srv:
        yield srv


def _client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)


def _request(case: dict[str, Any], upto: int) -> dict[str, Any]:
    req = case["request"]
    return {
        "model": MODEL,
        "messages": req["messages"][:upto],
        "tools": req["tools"],
        "reasoning_effort": req["reasoning_effort"],
        "extra_body": {"chat_template_kwargs": {"thinking": req["thinking"]}},
        "temperature": 0,
    }


def _fold_stream(chunks: list[Any]) -> dict[str, Any]:
    """Rebuild reasoning, content and tool calls from streamed deltas, checking their order."""
    reasoning, content, finish = "", "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        assert "｜DSML｜" not in (delta.content or ""), "raw markup leaked into content"
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.id.startswith("call_"), "a call's first delta has its id"
                assert tc.function and tc.function.name, "a call's first delta has its name"
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += (tc.function and tc.function.arguments) or ""
        finish = choice.finish_reason or finish
    return {
        "reasoning": reasoning,
        "content": content,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
    }


def test_tool_call_non_streaming(single: ServerThread) -> None:
    out = _client(single).chat.completions.create(**_request(ROUND_TRIP, 2))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert getattr(msg, "reasoning_content", None) == "Need the weather tool."
    assert not msg.content
    assert msg.tool_calls is not None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_tool_call_streaming_matches(single: ServerThread) -> None:
    client = _client(single)
    full = client.chat.completions.create(**_request(ROUND_TRIP, 2))
    folded = _fold_stream(
        list(client.chat.completions.create(stream=True, **_request(ROUND_TRIP, 2)))
    )
    assert folded["finish"] == "tool_calls"
    assert folded["reasoning"] == "Need the weather tool."
    assert folded["content"] == ""
    assert full.choices[0].message.tool_calls is not None
    expected = full.choices[0].message.tool_calls[0].function
    assert [(c["name"], c["arguments"]) for c in folded["calls"]] == [
        (expected.name, expected.arguments)
    ]


def test_tool_result_round_trip_prompt_is_byte_exact(single: ServerThread) -> None:
    """The history the client sends back renders to exactly the encoder golden."""
    client = _client(single)
    first = client.chat.completions.create(**_request(ROUND_TRIP, 2))
    reply = first.choices[0].message
    assert reply.tool_calls is not None
    call = reply.tool_calls[0]
    golden = ROUND_TRIP["request"]["messages"]
    messages = [
        *golden[:2],
        {
            "role": "assistant",
            "content": reply.content,
            "reasoning_content": getattr(reply, "reasoning_content", None),
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": golden[3]["content"]},
    ]
    seen: list[list[int]] = []
    single.state.on_submit = lambda _rid, ids: seen.append(ids)
    try:
        req = _request(ROUND_TRIP, 2)
        req["messages"] = messages
        second = client.chat.completions.create(**req)
    finally:
        single.state.on_submit = None
    assert second.choices[0].finish_reason == "tool_calls"
    assert len(seen) == 1
    tokenizer = single.state.engine.model.tokenizer
    assert tokenizer.decode(seen[0]) == ROUND_TRIP["prompt"]
    assert seen[0] == ROUND_TRIP["token_ids"]
    # The agent loop reuses the first turn from the prefix cache.
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= first.usage.prompt_tokens


def test_tool_choice_none_disables_tool_parsing(single: ServerThread) -> None:
    out = _client(single).chat.completions.create(tool_choice="none", **_request(ROUND_TRIP, 2))
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert not choice.message.tool_calls
    assert getattr(choice.message, "reasoning_content", None) == "Need the weather tool."


def _parallel_request() -> dict[str, Any]:
    tools = [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        for name in ("create_event", "send_email")
    ]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Plan it and tell everyone."}],
        "tools": tools,
        "temperature": 0,
    }


def test_parallel_tool_calls_intact(parallel: ServerThread) -> None:
    client = _client(parallel)
    expected = PARALLEL["expected"]
    full = client.chat.completions.create(**_parallel_request())
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert getattr(msg, "reasoning_content", None) == expected["reasoning_content"]
    assert msg.tool_calls is not None
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert got == [(c["name"], c["arguments"]) for c in expected["tool_calls"]]
    assert len({c.id for c in msg.tool_calls}) == 2
    folded = _fold_stream(list(client.chat.completions.create(stream=True, **_parallel_request())))
    assert folded["finish"] == "tool_calls"
    assert folded["reasoning"] == expected["reasoning_content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in folded["calls"]] == got


def test_parallel_tool_calls_false_keeps_first(parallel: ServerThread) -> None:
    out = _client(parallel).chat.completions.create(
        parallel_tool_calls=False, **_parallel_request()
    )
    calls = out.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["create_event"]


FILE_TEXT = "".join(f'line {i}: say "hi"\\n\t<tag> ok\n' for i in range(40))
WRITE_CALL = (
    "Writing it.</think>\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="write_file">\n'
    '<｜DSML｜parameter name="path" string="true">notes.txt</｜DSML｜parameter>\n'
    f'<｜DSML｜parameter name="text" string="true">{FILE_TEXT}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
WRITE_TOOL = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
            "required": ["path", "text"],
        },
    },
}


def test_a_long_argument_streams_in_fragments_over_http() -> None:
    """An agent writing a file through a tool sees the argument as it is generated."""
    with _server(WRITE_CALL) as srv:
        client = _client(srv)
        request: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write the notes."}],
            "tools": [WRITE_TOOL],
            "temperature": 0,
        }
        chunks = list(client.chat.completions.create(stream=True, **request))
        fragments = [
            tc.function.arguments
            for chunk in chunks
            for choice in chunk.choices
            for tc in choice.delta.tool_calls or []
            if tc.function is not None and tc.function.arguments
        ]
        firsts = [
            tc
            for chunk in chunks
            for choice in chunk.choices
            for tc in choice.delta.tool_calls or []
            if tc.id is not None
        ]
        whole = client.chat.completions.create(**request).choices[0].message
    assert len(fragments) >= 10
    assert len(firsts) == 1 and firsts[0].function is not None
    assert firsts[0].function.name == "write_file"
    assert whole.tool_calls is not None
    assert "".join(fragments) == whole.tool_calls[0].function.arguments
    assert json.loads("".join(fragments)) == {"path": "notes.txt", "text": FILE_TEXT}
    assert not any(choice.delta.content for chunk in chunks for choice in chunk.choices)
