"""Pipeline deltas -> Responses events: the pure writer (tables), the stream, the store."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from typing import Any, get_args

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from mlxserve.api.errors import APIError
from mlxserve.api.pipeline import (
    Accumulator,
    EngineRequestFailed,
    OutputDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from mlxserve.api.responses.events import ResponseEvents, ResponseShell
from mlxserve.api.responses.store import ResponseStore
from mlxserve.api.sealed import unseal_reasoning
from mlxserve.api.sse import SSE_COMMENT
from mlxserve.api.writer import RunEnd, stream_run

# The SDK's event classes by their `type` literal.
EVENT_TYPES = {
    get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in get_args(get_args(ResponseStreamEvent)[0])
}
SETTINGS = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
USAGE = Usage(prompt_tokens=100, completion_tokens=20, cached_tokens=60)
ARGS = '{"city": "Paris"}'


def _ids() -> Callable[[str], str]:
    counter = itertools.count()
    return lambda prefix: f"{prefix}_{next(counter)}"


def _shell(**kw: Any) -> ResponseShell:
    return ResponseShell("resp_1", "m", 1700000000, SETTINGS, **kw)


def _start(index: int, name: str = "get_weather") -> ToolCallDelta:
    return ToolCallDelta(index, f"call_{index}", name, "")


def _run(
    deltas: list[OutputDelta], finish: str = "stop", shell: ResponseShell | None = None
) -> tuple[list[dict[str, Any]], ResponseEvents]:
    shell = shell or _shell(include_encrypted=True)
    writer = ResponseEvents(shell, new_id=_ids(), count_tokens=lambda _t: 5)
    events = writer.start()
    for delta in deltas:
        events += writer.delta(delta)
    events += writer.finish(RunEnd(finish, None, USAGE))
    return events, writer


def response_body(
    shell: ResponseShell, acc: Accumulator, usage: Usage, count_tokens: Any = None
) -> dict[str, Any]:
    writer = ResponseEvents(shell, count_tokens=count_tokens)
    return writer.body(acc, RunEnd(acc.finish_reason or "stop", None, usage))


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


ITEM_ADDED = "output_item.added"
ITEM_DONE = "output_item.done"
TEXT_EVENTS = ["content_part.added", "output_text.delta"]
TEXT_DONE = ["output_text.done", "content_part.done", ITEM_DONE]

ORDER_CASES: list[tuple[str, list[OutputDelta], list[str]]] = [
    (
        "reasoning then text",
        [OutputDelta(reasoning="Hm"), OutputDelta(reasoning="m."), OutputDelta(content="Hi")],
        [
            "created",
            "in_progress",
            ITEM_ADDED,
            "reasoning_text.delta",
            "reasoning_text.delta",
            "reasoning_text.done",
            ITEM_DONE,
            ITEM_ADDED,
            *TEXT_EVENTS,
            *TEXT_DONE,
            "completed",
        ],
    ),
    (
        "reasoning then a call with arguments in one piece",
        [
            OutputDelta(reasoning="Need it."),
            OutputDelta(tool_calls=[_start(0)]),
            OutputDelta(tool_calls=[ToolCallDelta(0, arguments=ARGS)]),
        ],
        [
            "created",
            "in_progress",
            ITEM_ADDED,
            "reasoning_text.delta",
            "reasoning_text.done",
            ITEM_DONE,
            ITEM_ADDED,
            "function_call_arguments.delta",
            "function_call_arguments.done",
            ITEM_DONE,
            "completed",
        ],
    ),
    (
        "two calls, arguments in fragments",
        [
            OutputDelta(tool_calls=[_start(0), ToolCallDelta(0, arguments='{"city": ')]),
            OutputDelta(tool_calls=[ToolCallDelta(0, arguments='"Paris"}')]),
            OutputDelta(tool_calls=[_start(1), ToolCallDelta(1, arguments="{}")]),
        ],
        [
            "created",
            "in_progress",
            ITEM_ADDED,
            "function_call_arguments.delta",
            "function_call_arguments.delta",
            "function_call_arguments.done",
            ITEM_DONE,
            ITEM_ADDED,
            "function_call_arguments.delta",
            "function_call_arguments.done",
            ITEM_DONE,
            "completed",
        ],
    ),
    (
        "whitespace before a call makes no message",
        [
            OutputDelta(content="\n\n"),
            OutputDelta(tool_calls=[ToolCallDelta(0, "call_0", "f", "{}")]),
        ],
        [
            "created",
            "in_progress",
            ITEM_ADDED,
            "function_call_arguments.delta",
            "function_call_arguments.done",
            ITEM_DONE,
            "completed",
        ],
    ),
    (
        "an empty answer",
        [],
        ["created", "in_progress", "completed"],
    ),
]


@pytest.mark.parametrize(
    ("name", "deltas", "expected"), ORDER_CASES, ids=[c[0] for c in ORDER_CASES]
)
def test_event_order_and_numbering(
    name: str, deltas: list[OutputDelta], expected: list[str]
) -> None:
    events, writer = _run(deltas)
    assert _types(events) == expected
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)  # the SDK's typed stream accepts it
    # Item events name the item and output index their output_item.added gave.
    opened: dict[int, str] = {}
    for event in events:
        if event["type"] == "response.output_item.added":
            opened[event["output_index"]] = event["item"]["id"]
        elif "item_id" in event:
            assert opened[event["output_index"]] == event["item_id"]
    assert writer.final is not None
    assert [item["id"] for item in writer.final["output"]] == [opened[i] for i in sorted(opened)]
    Response.model_validate(writer.final)


def test_argument_fragments_concatenate_to_the_final_arguments() -> None:
    pieces = ['{"ci', 'ty": "Pa', 'ris"}']
    deltas = [OutputDelta(tool_calls=[_start(0)])]
    deltas += [OutputDelta(tool_calls=[ToolCallDelta(0, arguments=p)]) for p in pieces]
    events, writer = _run(deltas, finish="tool_calls")
    streamed = "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
    done = next(e for e in events if e["type"].endswith("arguments.done"))
    assert streamed == done["arguments"] == ARGS
    assert writer.final is not None and writer.final["output"][0]["arguments"] == ARGS


def test_a_call_without_arguments_streams_an_empty_object() -> None:
    events, writer = _run([OutputDelta(tool_calls=[_start(0)])])
    deltas = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
    assert deltas == ["{}"]
    assert writer.final is not None and writer.final["output"][0]["arguments"] == "{}"


def test_items_are_complete_and_reasoning_is_sealed() -> None:
    events, writer = _run(
        [
            OutputDelta(reasoning="Think ü."),
            OutputDelta(content="Answer."),
            OutputDelta(content="!"),
        ]
    )
    final = writer.final
    assert final is not None
    reasoning, message = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Think ü."}]
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    assert unseal_reasoning(reasoning["encrypted_content"]) == "Think ü."
    assert message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "Answer.!", "annotations": []}]
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["usage"] == {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 60, "cache_write_tokens": 0},
        "output_tokens": 20,
        "output_tokens_details": {"reasoning_tokens": 5},
        "total_tokens": 120,
    }
    assert final["tool_choice"] == "auto"  # the request's settings echoed
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert "encrypted_content" not in added["item"]


def test_no_encrypted_content_unless_included() -> None:
    _, writer = _run([OutputDelta(reasoning="Think.")], shell=_shell())
    assert writer.final is not None and "encrypted_content" not in writer.final["output"][0]


def test_namespaced_call_comes_back_with_its_namespace() -> None:
    shell = _shell(namespaces={"multi_agent_v1.spawn_agent": ("multi_agent_v1", "spawn_agent")})
    _, writer = _run(
        [OutputDelta(tool_calls=[ToolCallDelta(0, "call_0", "multi_agent_v1.spawn_agent", "{}")])],
        shell=shell,
    )
    assert writer.final is not None
    call = writer.final["output"][0]
    assert (call["namespace"], call["name"], call["call_id"]) == (
        "multi_agent_v1",
        "spawn_agent",
        "call_0",
    )
    assert call["id"].startswith("fc_")


def test_token_limit_is_incomplete() -> None:
    events, writer = _run([OutputDelta(reasoning="Long thought")], finish="length")
    assert events[-1]["type"] == "response.incomplete"
    assert writer.final is not None
    assert writer.final["status"] == "incomplete"
    assert writer.final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert writer.final["output"][0]["status"] == "incomplete"
    EVENT_TYPES[events[-1]["type"]].model_validate(events[-1])


def test_failure_is_an_error_event_then_response_failed() -> None:
    writer = ResponseEvents(_shell(), new_id=_ids())
    events = writer.start() + writer.delta(OutputDelta(content="Par"))
    events += writer.fail("generation failed: boom", USAGE)
    assert _types(events)[-2:] == ["error", "failed"]
    assert events[-2]["message"] == "generation failed: boom"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {
        "code": "server_error",
        "message": "generation failed: boom",
    }
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)


def _without_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in output]


def test_non_streaming_body_equals_the_streamed_response() -> None:
    deltas = [
        OutputDelta(reasoning="Need "),
        OutputDelta(reasoning="it."),
        OutputDelta(tool_calls=[_start(0), ToolCallDelta(0, arguments='{"city": ')]),
        OutputDelta(
            tool_calls=[ToolCallDelta(0, arguments='"Paris"}')], finish_reason="tool_calls"
        ),
    ]
    _, writer = _run(deltas, finish="tool_calls")
    acc = Accumulator()
    for delta in deltas:
        acc.add(delta)
    body = response_body(_shell(include_encrypted=True), acc, USAGE, count_tokens=lambda _t: 5)
    assert writer.final is not None
    assert _without_ids(body["output"]) == _without_ids(writer.final["output"])
    assert body["usage"] == writer.final["usage"]
    Response.model_validate(body)


def test_non_streaming_items_keep_the_order_of_text_and_calls() -> None:
    deltas = [
        OutputDelta(reasoning="Plan."),
        OutputDelta(content="Checking Paris."),
        OutputDelta(tool_calls=[_start(0), ToolCallDelta(0, arguments=ARGS)]),
        OutputDelta(content="And Rome."),
        OutputDelta(tool_calls=[_start(1), ToolCallDelta(1, arguments='{"city": "Rome"}')]),
        OutputDelta(content="Done.", finish_reason="tool_calls"),
    ]
    _, writer = _run(deltas, finish="tool_calls")
    acc = Accumulator()
    for delta in deltas:
        acc.add(delta)
    body = response_body(_shell(include_encrypted=True), acc, USAGE, count_tokens=lambda _t: 5)
    kinds = ["reasoning", "message", "function_call", "message", "function_call", "message"]
    assert [item["type"] for item in body["output"]] == kinds
    assert writer.final is not None
    assert _without_ids(body["output"]) == _without_ids(writer.final["output"])
    Response.model_validate(body)


def _lp(token: str) -> TokenLogprob:
    return TokenLogprob(token, -0.25, ((token, -0.25), ("ü", -1.5)))


def _tokens(logprobs: list[dict[str, Any]]) -> list[str]:
    return [lp["token"] for lp in logprobs]


LOGPROB_DELTAS = [
    OutputDelta(reasoning="Plan.", logprobs=[_lp("Plan.")]),
    OutputDelta(logprobs=[_lp("</think>")]),  # markup: no output of its own
    OutputDelta(content="Hi", logprobs=[_lp("Hi")]),
    OutputDelta(logprobs=[_lp(" th")]),  # held back (it could start a stop string)
    OutputDelta(content=" there", logprobs=[_lp("ere")]),
    OutputDelta(tool_calls=[_start(0), ToolCallDelta(0, arguments=ARGS)], logprobs=[_lp("<c>")]),
    OutputDelta(content="Done.", logprobs=[_lp("Done.")], finish_reason="tool_calls"),
]


def test_text_carries_the_logprobs_of_its_tokens_streamed_and_not() -> None:
    """Each text delta carries the tokens since the last output; reasoning and call
    tokens stay out; the done event and the part repeat the part's tokens in order."""
    shell = _shell(include_logprobs=True)
    events, writer = _run(LOGPROB_DELTAS, finish="tool_calls", shell=shell)
    deltas = [_tokens(e["logprobs"]) for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [["</think>", "Hi"], [" th", "ere"], ["Done."]]
    done = [_tokens(e["logprobs"]) for e in events if e["type"] == "response.output_text.done"]
    assert done == [["</think>", "Hi", " th", "ere"], ["Done."]]
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)
    assert writer.final is not None
    parts = [i["content"][0] for i in writer.final["output"] if i["type"] == "message"]
    assert [_tokens(part["logprobs"]) for part in parts] == done
    assert parts[1]["logprobs"] == [
        {
            "token": "Done.",
            "bytes": list(b"Done."),
            "logprob": -0.25,
            "top_logprobs": [
                {"token": "Done.", "bytes": list(b"Done."), "logprob": -0.25},
                {"token": "ü", "bytes": list("ü".encode()), "logprob": -1.5},
            ],
        }
    ]
    Response.model_validate(writer.final)
    acc = Accumulator()
    for delta in LOGPROB_DELTAS:
        acc.add(delta)
    body = response_body(shell, acc, USAGE)
    assert _without_ids(body["output"]) == _without_ids(writer.final["output"])


def test_no_logprobs_unless_included() -> None:
    events, writer = _run(LOGPROB_DELTAS, finish="tool_calls")
    assert all(not e.get("logprobs") for e in events)
    assert writer.final is not None
    parts = [i["content"][0] for i in writer.final["output"] if i["type"] == "message"]
    assert parts and all("logprobs" not in part for part in parts)


def _body(i: int) -> dict[str, Any]:
    return {"id": f"resp_{i}", "status": "completed", "output": []}


def test_store_is_a_bounded_lru() -> None:
    store = ResponseStore(2)
    store.put(_body(1), ({"type": "message"},))
    store.put(_body(2), ())
    assert store.get("resp_1").items == ({"type": "message"},)  # resp_1 is now the newest
    store.put(_body(3), ())
    assert len(store) == 2
    with pytest.raises(APIError) as info:
        store.get("resp_2")
    assert info.value.status == 404 and info.value.code == "response_not_found"
    with pytest.raises(APIError) as info:
        store.previous("resp_2")
    assert info.value.status == 400 and info.value.param == "previous_response_id"
    assert info.value.code == "previous_response_not_found"
    store.delete("resp_1")
    with pytest.raises(APIError):
        store.delete("resp_1")
    assert store.get("resp_3").body["id"] == "resp_3"


def test_store_is_bounded_in_bytes_too() -> None:
    """Each entry counts its whole conversation: a long chain cannot hold gigabytes."""
    turn = ({"type": "message", "content": "x" * 1000},)
    one = ResponseStore(100, max_bytes=10_000)
    assert one.put(_body(0), turn) and 1000 < one.nbytes < 1200
    store = ResponseStore(100, max_bytes=one.nbytes * 8)
    history: tuple[dict[str, Any], ...] = ()
    for i in range(6):  # a chain: each response holds the conversation so far
        history = history + turn
        store.put(_body(i), history)
    assert store.nbytes <= store.max_bytes
    assert len(store) < 6 and store.get("resp_5").items == history  # the newest stays
    with pytest.raises(APIError):
        store.get("resp_0")
    assert not store.put(_body(9), turn * 10)  # alone larger than the bound: not kept
    store.delete("resp_5")
    assert store.nbytes < store.max_bytes


def test_store_of_zero_keeps_nothing() -> None:
    store = ResponseStore(0)
    assert not store.put(_body(1), ())
    with pytest.raises(APIError):
        store.get("resp_1")
    with pytest.raises(ValueError):
        ResponseStore(-1)


class _FakeRun:
    """What the stream writer reads from a GenerationRun: its deltas and usage."""

    def __init__(self, deltas: list[OutputDelta | Exception], pause_s: float = 0.0) -> None:
        self._deltas = deltas
        self._pause_s = pause_s
        self.pipeline = type("P", (), {"usage": USAGE, "stop_string": None})()
        self.failures: list[str] = []  # what the status page would list

    def report_failure(self, message: str) -> None:
        self.failures.append(message)

    async def deltas(self) -> Any:
        for delta in self._deltas:
            await asyncio.sleep(self._pause_s)
            if isinstance(delta, Exception):
                raise delta
            yield delta


def _stream(run: _FakeRun, keepalive_s: float = 10.0) -> tuple[list[bytes], list[Any]]:
    kept: list[Any] = []
    writer = ResponseEvents(_shell(), new_id=_ids(), count_tokens=len, keep=kept.append)

    async def collect() -> list[bytes]:
        frames = stream_run(run, writer, keepalive_s)  # type: ignore[arg-type]
        return [frame async for frame in frames]

    return asyncio.run(collect()), kept


def _sse_types(frames: list[bytes]) -> list[str]:
    return [json.loads(f.split(b"data: ", 1)[1])["type"] for f in frames if f.startswith(b"event:")]


def test_stream_sends_keepalive_comments_while_waiting() -> None:
    run = _FakeRun([OutputDelta(content="Hi", finish_reason="stop")], pause_s=0.2)
    frames, kept = _stream(run, keepalive_s=0.02)
    assert SSE_COMMENT in frames
    assert _sse_types(frames)[-1] == "response.completed"
    assert len(kept) == 1 and kept[0]["status"] == "completed"
    assert kept[0]["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def test_stream_failure_is_error_then_response_failed_and_not_stored() -> None:
    run = _FakeRun([OutputDelta(content="Par"), EngineRequestFailed("step blew up")])
    frames, kept = _stream(run)
    types = _sse_types(frames)
    assert types[-2:] == ["error", "response.failed"]
    assert "response.completed" not in types and kept == []
    failed = json.loads(frames[-1].split(b"data: ", 1)[1])
    assert failed["response"]["error"]["message"] == "generation failed: step blew up"
    assert run.failures == ["generation failed: step blew up"]
