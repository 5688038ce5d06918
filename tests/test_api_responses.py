"""The Responses API end to end: the official `openai` client against mlxserve on loopback.

A scripted DeepSeek-V4 checkpoint (the real tokenizer and encoder; a model
that emits a given text after each assistant turn start) runs behind the
whole server: encoder, engine, prefix cache, DSML and reasoning parsers.
One server is a real `mlxserve serve` process; the others run the same app
in-process so the tests can see the token ids each turn submits.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_fixtures import (
    ServerThread,
    assert_error_shape,
    history_message,
    post,
    scripted_server,
    serve_args,
)

from mlxserve.models.tiny.scripted import write_checkpoint

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"
MODEL = "scripted-v4"
ASSISTANT = "<｜Assistant｜><think>"
EOS = "<｜end▁of▁sentence｜>"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name"}},
        "required": ["city"],
    },
    "strict": False,
}
HOSTED = {"type": "web_search", "external_web_access": False}
ENCRYPTED = ["reasoning.encrypted_content"]


def _call_script(reasoning: str, city: str) -> str:
    return (
        f"{reasoning}</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        f'<｜DSML｜parameter name="city" string="true">{city}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )


TOOL_TURN = _call_script("Need the weather tool.", "Paris")
ANSWER = "It is 22 degrees in Paris."
ANSWER_TURN = f"The tool answered.</think>{ANSWER}"


def _golden_round_trip() -> dict[str, Any]:
    for line in (DATA / "dsv4_encoder_public.jsonl").read_text(encoding="utf-8").splitlines():
        case = json.loads(line)
        if case["id"] == "enc-pub-0012":
            return dict(case)
    raise KeyError("enc-pub-0012")


ROUND_TRIP = _golden_round_trip()


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)


def _server(scripts: list[str], *extra: str) -> ServerThread:
    return scripted_server(scripts, *extra, model=MODEL)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlxserve serve` on a scripted checkpoint (a tool call, then an answer), loaded from
    its folder as the command does (a real `serve` process is
    `test_api_anthropic.test_real_serve_process_runs_a_tool_session`'s)."""
    ckpt = write_checkpoint(tmp_path_factory.mktemp("scripted"), [TOOL_TURN, ANSWER_TURN])
    args = serve_args("--served-model-name", MODEL, "--responses-store", "8", model=str(ckpt))
    with ServerThread(args, None) as srv:
        yield srv.base_url


def test_tool_turn_gives_reasoning_and_a_function_call(served: str) -> None:
    out = _client(served).responses.create(
        model=MODEL,
        input="What's the weather in Paris?",
        tools=[WEATHER, HOSTED],  # type: ignore[list-item]
        include=ENCRYPTED,  # type: ignore[list-item]
        store=False,
    )
    assert out.status == "completed" and out.object == "response" and out.id.startswith("resp_")
    assert [item.type for item in out.output] == ["reasoning", "function_call"]
    reasoning, call = out.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [c.text for c in reasoning.content] == ["Need the weather tool."]
    assert reasoning.encrypted_content
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert out.usage is not None and out.usage.output_tokens > 0
    assert 0 < out.usage.output_tokens_details.reasoning_tokens < out.usage.output_tokens


def test_typed_stream_accepts_every_event(served: str) -> None:
    client = _client(served)
    with client.responses.stream(
        model=MODEL,
        input="What's the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        store=False,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed"
    assert "response.reasoning_text.delta" in types and "response.reasoning_text.done" in types
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    call = final.output[-1]
    assert call.type == "function_call" and arguments == call.arguments
    assert json.loads(arguments) == {"city": "Paris"}


def test_stored_chain_get_and_delete(served: str) -> None:
    client = _client(served)
    first = client.responses.create(
        model=MODEL,
        input="What's the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
    )
    call = first.output[-1]
    assert call.type == "function_call"
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 22}'}],
        tools=[WEATHER],  # type: ignore[list-item]
    )
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output[-1].type == "function_call"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="Again?")
    assert gone.value.code == "previous_response_not_found"


@pytest.fixture(scope="module")
def golden() -> Iterator[ServerThread]:
    reply = ROUND_TRIP["prompt"]
    start = reply.index(ASSISTANT) + len(ASSISTANT)
    with _server([reply[start : reply.index(EOS, start)]], "--max-model-len", "4096") as srv:
        yield srv


def _golden_body(**extra: Any) -> dict[str, Any]:
    req = ROUND_TRIP["request"]
    fn = req["tools"][0]["function"]
    body = {
        "model": MODEL,
        "instructions": req["messages"][0]["content"],
        "tools": [{"type": "function", **fn}],
        "reasoning": {"effort": req["reasoning_effort"], "summary": "auto"},
        "include": ENCRYPTED,
    }
    body.update(extra)
    return body


def _submitted(srv: ServerThread, fn: Any) -> tuple[Any, list[list[int]]]:
    seen: list[list[int]] = []
    srv.state.on_submit = lambda _rid, ids: seen.append(ids)
    try:
        return fn(), seen
    finally:
        srv.state.on_submit = None


@pytest.mark.parametrize("stateful", [False, True], ids=["stateless", "previous_response_id"])
def test_function_call_output_renders_byte_exact(golden: ServerThread, stateful: bool) -> None:
    """The golden round trip sent back through /v1/responses renders the encoder golden."""
    client = _client(golden.base_url)
    user = ROUND_TRIP["request"]["messages"][1]
    tool_result = ROUND_TRIP["request"]["messages"][3]["content"]
    first = client.responses.create(
        **_golden_body(input=[{"role": "user", "content": user["content"]}], store=stateful)
    )
    call = first.output[-1]
    assert call.type == "function_call"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": tool_result}
    if stateful:
        body = _golden_body(previous_response_id=first.id, input=[output])
    else:
        items = [item.model_dump(exclude_none=True) for item in first.output]
        for item in items:  # a client that keeps only the encrypted reasoning
            item.pop("content", None) if item["type"] == "reasoning" else None
        body = _golden_body(input=[{"role": "user", "content": user["content"]}, *items, output])
        body["store"] = False
    _, seen = _submitted(golden, lambda: client.responses.create(**body))
    assert len(seen) == 1
    assert golden.state.engine.model.tokenizer.decode(seen[0]) == ROUND_TRIP["prompt"]
    assert seen[0] == ROUND_TRIP["token_ids"]


BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("unknown item type", {"input": [{"type": "telepathy"}]}, 400, "input[0].type"),
    (
        "function_call_output without its call",
        {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
        400,
        "input[0].call_id",
    ),
    (
        "unknown previous_response_id",
        {"input": "Hi", "previous_response_id": "resp_nope"},
        400,
        "previous_response_id",
    ),
    (
        "tool_choice naming a hosted tool",
        {"input": "Hi", "tools": [WEATHER, HOSTED], "tool_choice": {"type": "web_search"}},
        400,
        "tool_choice",
    ),
    (
        "max_output_tokens of the wrong type",
        {"input": "Hi", "max_output_tokens": "8"},
        400,
        "max_output_tokens",
    ),
    ("input of the wrong type", {"input": {"text": "Hi"}}, 400, "input"),
    (
        "max_output_tokens past the context",
        {"input": "Hi", "max_output_tokens": 100_000},
        400,
        "max_output_tokens",
    ),
    (
        "an image on a text-only model",
        {
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}
            ]
        },
        400,
        "input[0].content[0]",
    ),
    ("background", {"input": "Hi", "background": True}, 400, "background"),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "param"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_requests_get_openai_errors(
    golden: ServerThread, name: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    response = post(golden.url, "/v1/responses", {"model": MODEL, **body})
    err = assert_error_shape(response, status)
    assert err["param"] == param, err


def test_server_keeps_serving_after_bad_requests(golden: ServerThread) -> None:
    assert_error_shape(post(golden.url, "/v1/responses", content=b"{not json"), 400)
    assert_error_shape(httpx.get(golden.url + "/v1/responses/resp_unknown"), 404)
    assert_error_shape(httpx.delete(golden.url + "/v1/responses/resp_unknown"), 404)
    out = _client(golden.base_url).responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert out.status == "incomplete" and out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.usage is not None and out.usage.output_tokens == 4


# An agent session: seven tool turns, then the answer.
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Delhi", "Quito"]
SESSION = [_call_script(f"Step {i}: ask about {c}.", c) for i, c in enumerate(CITIES, 1)]
SESSION.append("All done.</think>Seven cities checked.")
QUESTION = "Check the weather in seven cities, one at a time."


def _turn(client: openai.OpenAI, body: dict[str, Any], stream: bool) -> Any:
    """One turn, streamed (what Codex does) or not; the final response either way."""
    if not stream:
        return client.responses.create(**body)
    with client.responses.stream(**body) as events:
        return events.get_final_response()


def _responses_session(srv: ServerThread, stateful: bool) -> tuple[list[list[int]], list[int]]:
    """Eight turns through /v1/responses: the prompts submitted and cached_tokens per turn."""
    client = _client(srv.base_url)
    items: list[Any] = [{"role": "user", "content": QUESTION}]
    new_input: list[Any] = list(items)
    previous: str | None = None
    prompts: list[list[int]] = []
    cached: list[int] = []
    sizes: list[int] = []
    for turn in range(8):
        body: dict[str, Any] = {"model": MODEL, "tools": [WEATHER], "include": ENCRYPTED}
        if stateful:
            body.update(input=new_input, previous_response_id=previous)
        else:
            body.update(input=items, store=False)
        out, seen = _submitted(srv, lambda: _turn(client, body, stream=turn % 2 == 1))  # noqa: B023
        prompts += seen
        assert out.usage is not None
        cached.append(out.usage.input_tokens_details.cached_tokens)
        sizes.append(out.usage.input_tokens)
        output = [item.model_dump(exclude_none=True) for item in out.output]
        if turn == 7:
            assert out.output_text == "Seven cities checked."
            break
        call = output[-1]
        assert call["type"] == "function_call" and json.loads(call["arguments"]) == {
            "city": CITIES[turn]
        }
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "22 C"}
        items += [*output, result]
        new_input, previous = [result], out.id
    print(f"stateful={stateful} input_tokens={sizes} cached_tokens={cached}")
    return prompts, cached


def _chat_session(srv: ServerThread) -> list[list[int]]:
    """The same session through /v1/chat/completions."""
    client = _client(srv.base_url)
    tools = [
        {
            "type": "function",
            "function": {k: WEATHER[k] for k in ("name", "description", "parameters", "strict")},
        }
    ]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    prompts: list[list[int]] = []
    for _ in range(8):
        out, seen = _submitted(
            srv,
            lambda: client.chat.completions.create(model=MODEL, messages=messages, tools=tools),  # noqa: B023
        )
        prompts += seen
        msg = out.choices[0].message
        if not msg.tool_calls:
            break
        call = msg.tool_calls[0]
        messages.append(history_message(msg))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "22 C"})
    return prompts


@pytest.mark.parametrize("stateful", [False, True], ids=["stateless", "previous_response_id"])
def test_eight_turn_session_hits_the_cache_and_matches_chat(stateful: bool) -> None:
    with _server(SESSION) as srv:
        prompts, cached = _responses_session(srv, stateful)
        chat = _chat_session(srv)
    assert len(prompts) == 8 and all(c > 0 for c in cached[1:]), cached
    # Each turn's prompt extends the last one's, and equals the chat-completions prompt.
    assert all(b[: len(a)] == a for a, b in itertools.pairwise(prompts))
    assert chat == prompts


NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Spawn a sub-agent.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"message": {"type": "string"}},
                "required": ["message"],
            },
        }
    ],
}
SPAWN = (
    "Spawn a helper.</think>\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="multi_agent_v1.spawn_agent">\n'
    '<｜DSML｜parameter name="message" string="true">Count files</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def test_namespaced_function_round_trip() -> None:
    """A Codex-shaped request: a namespace call comes back split, and re-renders the same."""
    tools = [WEATHER, NAMESPACE, HOSTED]
    body: dict[str, Any] = {"model": MODEL, "tools": tools, "include": ENCRYPTED, "store": False}
    with _server([SPAWN, "Done.</think>The helper is running."]) as srv:
        client = _client(srv.base_url)
        question = {"role": "user", "content": "Start a helper."}
        with client.responses.stream(input=[question], **body) as stream:
            added = [e for e in stream if e.type == "response.output_item.added"]
            first = stream.get_final_response()
        assert added[-1].item.type == "function_call"
        call = first.output[-1]
        assert call.type == "function_call"
        assert (call.namespace, call.name) == ("multi_agent_v1", "spawn_agent")
        assert json.loads(call.arguments) == {"message": "Count files"}
        items = [item.model_dump(exclude_none=True) for item in first.output]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "started"}
        second = client.responses.create(input=[question, *items, result], **body)
    assert second.output_text == "The helper is running."
    assert first.usage is not None and second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 1
