"""Structured output that cannot fail, with random-weight models as the adversary.

Through the real `openai` client over HTTP, at temperature 1.0: forced tool
calls (`tool_choice` required and named) and `response_format` json_schema
must parse and validate with `jsonschema` on DeepSeek-V4 (DSML), V4.1 (DSML)
and Qwen3 (Hermes) tiny checkpoints, streaming and not. A request that runs
out of `max_tokens` may end with `length`; any other finish must be valid. A
named choice over bounded arguments is always exactly one complete call.
`MLXSERVE_STRUCTURED_SEEDS` raises the seed count (the issues' checks are 50
and 20).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from api_fixtures import ServerThread, serve_args

from mlxserve.models import load

pytestmark = pytest.mark.slow

# A few seeds per family in the suite (each a handful of requests on every route); the
# issues' seed counts run with the variable set.
SEEDS = int(os.environ.get("MLXSERVE_STRUCTURED_SEEDS", "2"))
# The long-string check writes ~60 tokens a request, twice a seed.
LONG_SEEDS = int(os.environ.get("MLXSERVE_STRUCTURED_SEEDS", "1"))
FAMILIES = ("deepseek_v4", "deepseek_v41", "qwen3")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["city", "days"],
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 10, "pattern": "^[^\\n]*$"},
        "slots": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                    "room": {"enum": ["a", "b"]},
                },
                "required": ["hour", "room"],
            },
            "maxItems": 2,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["title", "slots", "ok"],
}
# A long constrained string (DSML writes it raw and streams it piece by piece),
# a format, and a JSON value beside them.
NOTE = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "minLength": 120, "maxLength": 160},
        "due": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["text", "due"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "plan_event", "parameters": EVENT}},
    {"type": "function", "function": {"name": "write_note", "parameters": NOTE}},
]
SCHEMAS = {"get_weather": WEATHER, "plan_event": EVENT, "write_note": NOTE}


@pytest.fixture(scope="module", params=FAMILIES)
def server(request: Any, model_dir_factory: Callable[..., Path]) -> Iterator[ServerThread]:
    path = model_dir_factory(request.param)
    args = serve_args("--served-model-name", "m", "--max-num-seqs", "4", model=str(path))
    with ServerThread(args, lambda: load(path)) as srv:
        yield srv


def _client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)


def _base(seed: int) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Go."}],
        "max_tokens": 160,
        "temperature": 1.0,
        "seed": seed,
        # Random weights never close a reasoning block: constrain from the first token.
        "extra_body": {"chat_template_kwargs": {"thinking": False, "enable_thinking": False}},
    }


def _calls(srv: ServerThread, stream: bool, **kw: Any) -> tuple[str | None, list[tuple[str, str]]]:
    finish, calls, _ = _calls_and_fragments(srv, stream, **kw)
    return finish, calls


def _calls_and_fragments(
    srv: ServerThread, stream: bool, **kw: Any
) -> tuple[str | None, list[tuple[str, str]], list[int]]:
    """(finish reason, [(name, arguments)], argument fragments per call)."""
    client = _client(srv)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.finish_reason, calls, [1] * len(calls)
    finish: str | None = None
    parts: dict[int, list[str]] = {}
    fragments: dict[int, int] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                entry = parts.setdefault(tc.index, ["", ""])
                entry[0] += (tc.function and tc.function.name) or ""
                piece = (tc.function and tc.function.arguments) or ""
                entry[1] += piece
                fragments[tc.index] = fragments.get(tc.index, 0) + bool(piece)
    order = sorted(parts)
    return finish, [(parts[i][0], parts[i][1]) for i in order], [fragments.get(i, 0) for i in order]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_forced_tool_calls_validate(server: ServerThread, stream: bool) -> None:
    valid = 0
    for seed in range(SEEDS):
        finish, calls = _calls(
            server, stream, tools=TOOLS[:2], tool_choice="required", **_base(seed)
        )
        if finish == "length":
            continue
        assert finish == "tool_calls", (seed, finish, calls)
        assert calls, seed
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        valid += 1
    assert valid >= 1, "every request ran out of tokens"


def test_a_named_choice_is_one_call_and_its_long_string_streams_in_pieces(
    server: ServerThread,
) -> None:
    """A named `tool_choice` (with `parallel_tool_calls` at its default) is exactly one
    valid call, finished as `tool_calls`, streamed and not; its 120-160 character string
    streams in many fragments, which add up to the arguments the whole answer has."""
    named = {"type": "function", "function": {"name": "write_note"}}
    # Bounded: every value has a maximum length, so the call always completes.
    kw = {**_base(0), "max_tokens": 640, "tools": TOOLS, "tool_choice": named}
    for seed in range(LONG_SEEDS):
        kw["seed"] = seed
        whole = _calls_and_fragments(server, False, **kw)
        finish, calls, fragments = _calls_and_fragments(server, True, **kw)
        for reason, answer in ((whole[0], whole[1]), (finish, calls)):
            assert reason == "tool_calls", (seed, reason, answer)
            assert [name for name, _ in answer] == ["write_note"], (seed, answer)
            jsonschema.validate(json.loads(answer[0][1]), NOTE)
        assert fragments[0] >= 10, (seed, fragments)
        # The same seed samples the same tokens: the fragments add up to the whole answer.
        assert calls == whole[1], seed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_answers_validate(server: ServerThread, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "event", "schema": EVENT}}
    client = _client(server)
    valid = 0
    for seed in range(SEEDS):
        if stream:
            text, finish = "", None
            for chunk in client.chat.completions.create(
                stream=True, response_format=fmt, **_base(seed)
            ):
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
        else:
            choice = client.chat.completions.create(response_format=fmt, **_base(seed)).choices[0]
            text, finish = choice.message.content or "", choice.finish_reason
        if finish == "length":
            continue
        assert finish == "stop", (seed, finish, text)
        jsonschema.validate(json.loads(text), EVENT)
        valid += 1
    assert valid >= 1, "every request ran out of tokens"


def test_parallel_false_gives_one_call(server: ServerThread) -> None:
    complete = 0
    for seed in range(SEEDS):
        finish, calls = _calls(
            server,
            False,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            **_base(seed),
        )
        if finish != "length":
            assert len(calls) == 1, calls
            complete += 1
    assert complete >= 1, "every request ran out of tokens"


def test_unconstrained_rows_beside_constrained_ones_keep_their_tokens(server: ServerThread) -> None:
    """Greedy output of a free request is the same alone and next to constrained ones."""
    from concurrent.futures import ThreadPoolExecutor

    client = _client(server)
    free = {**_base(0), "temperature": 0, "max_tokens": 24}
    alone = client.chat.completions.create(**free).choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    with ThreadPoolExecutor(4) as pool:
        constrained = [
            pool.submit(client.chat.completions.create, response_format=fmt, **_base(s))
            for s in range(3)
        ]
        beside = pool.submit(client.chat.completions.create, **free)
        for f in constrained:
            f.result()
        assert beside.result().choices[0].message.content == alone


def test_thinking_stays_free_and_the_grammar_starts_after_it() -> None:
    """Reasoning is not constrained; the answer after `</think>` is."""
    from api_fixtures import scripted_server

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    # The scripted reasoning would break the grammar if it were constrained.
    with scripted_server('Think {not json.</think>{"a": 12}') as srv:
        choice = (
            _client(srv)
            .chat.completions.create(
                model="scripted-v4",
                messages=[{"role": "user", "content": "Go."}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": schema},
                },
                max_tokens=64,
            )
            .choices[0]
        )
    assert choice.finish_reason == "stop"
    assert getattr(choice.message, "reasoning_content", None) == "Think {not json."
    assert json.loads(choice.message.content or "") == {"a": 12}


def test_strict_auto_leaves_text_alone_and_mends_a_bad_call() -> None:
    """`tool_choice: auto` with a strict function: free text passes as it is; a call the
    model opens must satisfy the schema (the scripted call's `days` is out of range)."""
    from api_fixtures import scripted_server

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
        "required": ["city", "days"],
    }
    tool = {
        "type": "function",
        "function": {"name": "weather", "parameters": schema, "strict": True},
    }
    call = (
        "Checking.</think>Let me look.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="weather">\n'
        '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">9</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    request = {
        "model": "scripted-v4",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [tool],
        "max_tokens": 96,
        "temperature": 0,
    }
    second_turn = "Checking.</think>No call {needed}."
    with scripted_server([call, second_turn]) as srv:
        client = _client(srv)
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.message.content == "Let me look.", repr(choice.message.content)
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls is not None
        args = json.loads(choice.message.tool_calls[0].function.arguments)
        jsonschema.validate(args, schema)
        assert args["city"] == "Oslo"
        # The second assistant turn of the script writes text only, left as it is.
        follow = {
            **request,
            "messages": [
                *request["messages"],
                {
                    "role": "assistant",
                    "content": "Let me look.",
                    "tool_calls": [tc.model_dump() for tc in choice.message.tool_calls],
                },
                {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sun"},
            ],
        }
        second = client.chat.completions.create(**follow).choices[0]
        assert second.message.content == "No call {needed}."
        assert second.finish_reason == "stop"
