"""The Anthropic Messages route end to end, through the official `anthropic` client.

A scripted checkpoint (`mlxserve make-model --family scripted`: the real
DeepSeek-V4 tokenizer and encoder, a model that emits a script after each
assistant turn start) is loaded by the real loader behind the real server on
loopback. The first script calls a tool (DSML), the second answers in text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from api_fixtures import ServerThread, history_message, serve_args

from mlxserve.models import load
from mlxserve.models.tiny.scripted import write_checkpoint

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"
MODEL = "scripted-v4"
REASONING = "Need the weather tool."
CALL = (
    REASONING + "</think>\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
ANSWER = "Done.</think>It is 22 degrees in Paris."
SYSTEM = "You are a helpful assistant."
QUESTION = "What's the weather in Paris?"
WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}


def _golden(case_id: str) -> dict[str, Any]:
    for line in (DATA / "dsv4_encoder_public.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip() and json.loads(line)["id"] == case_id:
            return dict(json.loads(line))
    raise KeyError(case_id)


def _server(tmp: Path, scripts: list[str], *extra: str) -> ServerThread:
    path = write_checkpoint(tmp, scripts)
    args = serve_args("--served-model-name", MODEL, *extra, model=str(path))
    return ServerThread(args, lambda: load(path))


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with _server(tmp_path_factory.mktemp("scripted"), [CALL, ANSWER]) as server:
        yield server


@pytest.fixture(scope="module")
def looping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A model that calls the tool on every turn (one script, repeated)."""
    with _server(tmp_path_factory.mktemp("looping"), [CALL]) as server:
        yield server


def _client(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


def _request(messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 4096,
        "system": SYSTEM,
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "thinking": {"type": "enabled", "budget_tokens": 8192},
    }
    body.update(kw)
    return body


def _capture(server: ServerThread) -> list[list[int]]:
    seen: list[list[int]] = []
    server.state.on_submit = lambda _rid, ids: seen.append(ids)
    return seen


def _assert_tool_turn(message: Any) -> None:
    assert message.stop_reason == "tool_use"
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "tool_use"], kinds
    thinking, tool_use = message.content
    assert thinking.thinking == REASONING and thinking.signature
    assert tool_use.id.startswith("toolu_") and tool_use.name == "get_weather"
    assert tool_use.input == {"city": "Paris", "unit": "celsius"}


def test_tool_use_turn_non_streaming(srv: ServerThread) -> None:
    message = _client(srv).messages.create(**_request([{"role": "user", "content": QUESTION}]))
    _assert_tool_turn(message)
    assert message.id.startswith("msg_") and message.model == MODEL
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_tool_use_turn_streaming(srv: ServerThread) -> None:
    client = _client(srv)
    request = _request([{"role": "user", "content": QUESTION}])
    with client.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    _assert_tool_turn(final)
    names = [e.type for e in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "signature_delta" in deltas
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == final.content[1].input
    # Blocks open and close in order, each index once.
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == [0, 1]


def test_raw_stream_has_ping_and_event_lines(srv: ServerThread) -> None:
    body = _request([{"role": "user", "content": QUESTION}], stream=True)
    with (
        httpx.Client(base_url=srv.url, timeout=60) as http,
        http.stream("POST", "/v1/messages?beta=true", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    names = [line[len("event: ") :] for line in text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert "｜DSML｜" not in text


def test_tool_result_round_trip_is_byte_exact(srv: ServerThread) -> None:
    """The history Claude Code re-sends renders exactly DeepSeek's reference prompt."""
    client = _client(srv)
    golden = _golden("enc-pub-0012")
    first = client.messages.create(**_request([{"role": "user", "content": QUESTION}]))
    tool_use = first.content[1]
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": tool_use.id, "content": '{"temp": 22}'}
            ],
        },
    ]
    seen = _capture(srv)
    try:
        second = client.messages.create(
            **_request(history, thinking={"type": "adaptive"}, output_config={"effort": "high"})
        )
    finally:
        srv.state.on_submit = None
    assert seen[0] == golden["token_ids"]
    assert srv.state.engine.model.tokenizer.decode(seen[0]) == golden["prompt"]
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["thinking", "text"]
    assert second.content[1].text == "It is 22 degrees in Paris."
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens - 1


def test_omitted_thinking_still_renders_the_same_prompt(srv: ServerThread) -> None:
    """`display: "omitted"` sends no thinking text; the signature carries it back."""
    client = _client(srv)
    omitted = {"type": "adaptive", "display": "omitted"}
    first = client.messages.create(
        **_request([{"role": "user", "content": QUESTION}], thinking=omitted)
    )
    assert first.content[0].type == "thinking" and first.content[0].thinking == ""
    shown = client.messages.create(**_request([{"role": "user", "content": QUESTION}]))

    def follow_up(reply: Any) -> list[dict[str, Any]]:
        blocks = [b.model_dump(exclude_none=True) for b in reply.content]
        blocks[1]["id"] = "toolu_same"
        result = {"type": "tool_result", "tool_use_id": "toolu_same", "content": "22"}
        return [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": [result]},
        ]

    seen = _capture(srv)
    try:
        client.messages.create(**_request(follow_up(first), thinking=omitted))
        client.messages.create(**_request(follow_up(shown), thinking=omitted))
    finally:
        srv.state.on_submit = None
    assert len(seen) == 2 and seen[0] == seen[1]
    assert REASONING in srv.state.engine.model.tokenizer.decode(seen[0])


def _tool_session(server: ServerThread, turns: int) -> tuple[list[Any], list[list[int]]]:
    """An agent loop: every reply calls the tool; the client answers each call."""
    client = _client(server)
    history: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    replies: list[Any] = []
    seen = _capture(server)
    try:
        for turn in range(turns):
            stream = turn % 2 == 1
            if stream:
                with client.messages.stream(**_request(history)) as s:
                    reply = s.get_final_message()
            else:
                reply = client.messages.create(**_request(history))
            replies.append(reply)
            assert reply.stop_reason == "tool_use"
            blocks = [b.model_dump(exclude_none=True) for b in reply.content]
            history.append({"role": "assistant", "content": blocks})
            result = f'{{"temp": {20 + turn}}}'
            history.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": blocks[-1]["id"], "content": result}
                    ],
                }
            )
    finally:
        server.state.on_submit = None
    return replies, seen


def test_eight_turn_tool_session_hits_the_prefix_cache(looping: ServerThread) -> None:
    replies, seen = _tool_session(looping, 8)
    for turn, reply in enumerate(replies[1:], start=2):
        assert reply.usage.cache_read_input_tokens > 0, f"turn {turn} missed the prefix cache"
    # Each prompt extends the previous one: the history re-renders byte for byte.
    for before, after in zip(seen, seen[1:], strict=False):
        assert after[: len(before)] == before


def _openai_session(server: ServerThread, turns: int) -> list[list[int]]:
    """The same agent loop through /v1/chat/completions."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    tool = {
        "type": "function",
        "function": {
            "name": WEATHER_TOOL["name"],
            "description": WEATHER_TOOL["description"],
            "parameters": WEATHER_TOOL["input_schema"],
        },
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    seen = _capture(server)
    try:
        for turn in range(turns):
            out = client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                tools=[tool],  # type: ignore[list-item]
                temperature=0,
                reasoning_effort="high",
                extra_body={"chat_template_kwargs": {"thinking": True}},
            )
            msg = out.choices[0].message
            assert msg.tool_calls
            call = msg.tool_calls[0]
            messages.append(history_message(msg))
            content = f'{{"temp": {20 + turn}}}'
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    finally:
        server.state.on_submit = None
    return seen


def test_same_session_through_both_routes_builds_the_same_prompts(looping: ServerThread) -> None:
    _, anthropic_prompts = _tool_session(looping, 3)
    openai_prompts = _openai_session(looping, 3)
    assert anthropic_prompts == openai_prompts


def test_max_tokens_is_clamped_to_the_context(srv: ServerThread) -> None:
    body = _request([{"role": "user", "content": QUESTION}], max_tokens=10_000_000, stream=True)
    with _client(srv).messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"


def test_count_tokens_matches_the_prompt(srv: ServerThread) -> None:
    client = _client(srv)
    request = _request([{"role": "user", "content": QUESTION}])
    counted = client.messages.count_tokens(
        model=MODEL,
        system=request["system"],
        messages=request["messages"],
        tools=request["tools"],
        thinking=request["thinking"],
    )
    seen = _capture(srv)
    try:
        client.messages.create(**request)
    finally:
        srv.state.on_submit = None
    assert counted.input_tokens == len(seen[0])


def test_claude_code_shaped_request(srv: ServerThread) -> None:
    """The fields Claude Code sends: system blocks, betas, a system message, defer_loading."""
    body = {
        "model": MODEL,
        "max_tokens": 128000,
        "stream": True,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "user_abc"},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [
            {**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}},
            {**WEATHER_TOOL, "name": "ToolSearch", "defer_loading": True},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": QUESTION, "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": "<env>Working directory: /tmp</env>"},
        ],
    }
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "x-api-key": "x",
    }
    with (
        httpx.Client(base_url=srv.url, timeout=60) as http,
        http.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200, response.read()
        text = "".join(response.iter_text())
    assert '"stop_reason":"tool_use"' in text
    assert '"thinking_delta"' not in text and '"signature_delta"' in text


def test_api_key_accepts_x_api_key_and_bearer(tmp_path: Path) -> None:
    with _server(tmp_path, [ANSWER], "--api-key", "sekret") as server:
        body = _request([{"role": "user", "content": QUESTION}])
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.post("/v1/messages", json=body, headers={"x-api-key": "sekret"}).is_success
            bearer = {"Authorization": "Bearer sekret"}
            assert http.post("/v1/messages", json=body, headers=bearer).is_success
            denied = http.post("/v1/messages", json=body, headers={"x-api-key": "nope"})
        assert denied.status_code == 401
        assert denied.json()["type"] == "error"
        assert denied.json()["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
                **body
            )


def test_real_serve_process_runs_a_tool_session(tmp_path: Path) -> None:
    """`mlxserve make-model --family scripted` + `mlxserve serve` as a user runs them."""
    from api_fixtures import ServeProcess

    from mlxserve.cli import main

    ckpt = tmp_path / "ckpt"
    assert (
        main(
            ["make-model", str(ckpt), "--family", "scripted", "--script", CALL, "--script", ANSWER]
        )
        == 0
    )
    with ServeProcess(str(ckpt), "--served-model-name", MODEL) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
        first = client.messages.create(**_request([{"role": "user", "content": QUESTION}]))
        _assert_tool_turn(first)
        history = [
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": first.content[1].id, "content": "22"}
                ],
            },
        ]
        with client.messages.stream(**_request(history)) as stream:
            second = stream.get_final_message()
        assert second.stop_reason == "end_turn"
        assert second.content[-1].text == "It is 22 degrees in Paris."
        assert second.usage.cache_read_input_tokens > 0
