"""Replay across a restart on all three dialects, through the official clients.

A conversation's first turn (a tool call) is served, the server is stopped and
a new one started on the same `--prefix-cache-dir`; the client then sends the
next turn with the history it holds. It must render byte for byte the prompt
it would have rendered without the restart: the cached tokens equal those of
the same two turns served by one server from RAM, and they came from disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from api_fixtures import ServerThread, history_message, metric, scripted_server

pytestmark = pytest.mark.slow

MODEL = "scripted-v4"
CALL = (
    "Need the weather tool.</think>\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
ANSWER = "The tool answered.</think>It is 22 degrees in Paris."
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "City name"}},
    "required": ["city"],
}
RESULT = '{"temp": 22}'


def _server(disk: Path) -> ServerThread:
    return scripted_server([CALL, ANSWER], "--prefix-cache-dir", str(disk), model=MODEL)


def _openai(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)


# -- each dialect: a first turn that returns the client's state, and a second turn
# -- that sends the history back and returns the cached prompt tokens -----------


def _chat_first(srv: ServerThread) -> Any:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
    messages = [{"role": "user", "content": "Chat: what's the weather in Paris?"}]
    reply = _openai(srv).chat.completions.create(
        model=MODEL, messages=messages, tools=[tool], reasoning_effort="high"
    )  # type: ignore[call-overload]
    return messages, tool, reply.choices[0].message


def _chat_second(srv: ServerThread, state: Any) -> int:
    messages, tool, message = state
    call = message.tool_calls[0]
    history = [*messages, history_message(message)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": RESULT})
    reply = _openai(srv).chat.completions.create(
        model=MODEL, messages=history, tools=[tool], reasoning_effort="high"
    )  # type: ignore[call-overload]
    assert reply.choices[0].message.content == "It is 22 degrees in Paris."
    return int(reply.usage.prompt_tokens_details.cached_tokens)


def _anthropic_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    tool = {"name": "get_weather", "description": "Weather", "input_schema": PARAMETERS}
    return {
        "model": MODEL,
        "max_tokens": 1024,
        "system": "You are Claude Code.",
        "messages": messages,
        "tools": [tool],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }


def _anthropic(srv: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)


def _anthropic_first(srv: ServerThread) -> Any:
    question = {"role": "user", "content": "Messages: what's the weather in Paris?"}
    return question, _anthropic(srv).messages.create(**_anthropic_body([question]))


def _anthropic_second(srv: ServerThread, state: Any) -> int:
    question, first = state
    tool_use = next(b for b in first.content if b.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": tool_use.id, "content": RESULT}
    history = [
        question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [result]},
    ]
    second = _anthropic(srv).messages.create(**_anthropic_body(history))
    assert second.stop_reason == "end_turn"
    return int(second.usage.cache_read_input_tokens or 0)


def _responses_body() -> dict[str, Any]:
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMETERS, "strict": False}
    return {
        "model": MODEL,
        "tools": [tool],
        "include": ["reasoning.encrypted_content"],
        "store": False,
    }


def _responses_first(srv: ServerThread) -> Any:
    question = {"role": "user", "content": "Responses: what's the weather in Paris?"}
    first = _openai(srv).responses.create(input=[question], **_responses_body())
    return question, first


def _responses_second(srv: ServerThread, state: Any) -> int:
    question, first = state
    call = first.output[-1]
    assert call.type == "function_call"
    items = [item.model_dump(exclude_none=True) for item in first.output]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    second = _openai(srv).responses.create(input=[question, *items, output], **_responses_body())
    assert second.output_text == "It is 22 degrees in Paris."
    return int(second.usage.input_tokens_details.cached_tokens)


DIALECTS: dict[str, tuple[Callable[[ServerThread], Any], Callable[[ServerThread, Any], int]]] = {
    "chat": (_chat_first, _chat_second),
    "anthropic": (_anthropic_first, _anthropic_second),
    "responses": (_responses_first, _responses_second),
}


def test_each_dialect_replays_its_next_turn_from_disk_after_a_restart(tmp_path: Path) -> None:
    with _server(tmp_path / "ram") as srv:
        states = {name: first(srv) for name, (first, _) in DIALECTS.items()}
        from_ram = {name: second(srv, states[name]) for name, (_, second) in DIALECTS.items()}
    assert all(cached > 0 for cached in from_ram.values()), from_ram

    disk = tmp_path / "disk"
    with _server(disk) as srv:
        states = {name: first(srv) for name, (first, _) in DIALECTS.items()}
    with _server(disk) as srv:
        restored = {name: second(srv, states[name]) for name, (_, second) in DIALECTS.items()}
        stats = httpx.get(srv.url + "/v1/cache/stats", timeout=30).json()
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    assert restored == from_ram
    assert stats["disk"]["hits"] == len(DIALECTS)
    assert stats["disk"]["restored_tokens"] == sum(restored.values())
    assert stats["disk"]["entries"] >= 1 and stats["disk"]["bytes"] > 0
    assert metric(metrics, "mlxserve_prefix_cache_disk_hits_total") == len(DIALECTS)
    assert metric(metrics, "mlxserve_prefix_cache_disk_dropped_writes_total") == 0
    assert json.dumps(stats)  # the body is plain JSON
