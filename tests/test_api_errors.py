"""Client errors, overload, auth and disconnects against a real server.

Every error is a 4xx in the OpenAI shape, and the server answers a normal
request afterwards. The scripted model talks for thousands of tokens, so
requests stay busy for as long as a test needs them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from api_fixtures import ServerThread, assert_error_shape, chat_body, metric, serve_args

from mlxserve.engine.request import RequestStatus
from mlxserve.models.tiny.scripted import scripted_model

pytestmark = pytest.mark.slow

KEY = "s3cret-key"
MODEL = "test-model"
LIMIT = 8192
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    args = serve_args(
        "--served-model-name",
        MODEL,
        "--api-key",
        KEY,
        "--max-model-len",
        str(LIMIT),
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
        "--tool-call-parser",
        "deepseek_v4",
        "--reasoning-parser",
        "deepseek_v4",
    )
    args.max_body_bytes = 64 * 1024
    with ServerThread(args, lambda: scripted_model("tick " * 4000)) as srv:
        yield srv


@pytest.fixture()
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


def _serves_normally(http: httpx.Client) -> None:
    body = chat_body(max_tokens=3, chat_template_kwargs={"thinking": False})
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "tick tick"  # "t", "ick", " tick"


def _error(http: httpx.Client, status: int, body: Any = None, **kw: Any) -> dict[str, Any]:
    if body is not None:
        kw["json"] = body
    err = assert_error_shape(http.post("/v1/chat/completions", **kw), status)
    _serves_normally(http)
    return err


def test_missing_or_wrong_api_key(server: ServerThread, http: httpx.Client) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as anon:
        err = assert_error_shape(anon.post("/v1/chat/completions", json=chat_body()), 401)
        assert err["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        assert_error_shape(anon.post("/v1/chat/completions", json=chat_body(), headers=wrong), 401)
        assert_error_shape(anon.get("/v1/models"), 401)
        assert anon.get("/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="bad", max_retries=0).models.list()
    _serves_normally(http)


def test_malformed_json(http: httpx.Client) -> None:
    err = _error(http, 400, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert "JSON" in err["message"]


def test_field_of_the_wrong_type(http: httpx.Client) -> None:
    err = _error(http, 400, chat_body(temperature="hot"))
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
    err = _error(http, 400, chat_body(stream="yes"))
    assert err["param"] == "stream"


def test_empty_messages(http: httpx.Client) -> None:
    err = _error(http, 400, {"model": MODEL, "messages": []})
    assert err["param"] == "messages"


def test_unknown_role(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}
    assert "role" in _error(http, 400, body)["message"]


def test_prompt_plus_max_tokens_beyond_max_model_len(http: httpx.Client) -> None:
    err = _error(http, 400, chat_body(max_tokens=LIMIT))
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    err = _error(http, 400, chat_body(content="word " * (LIMIT + 10)))
    assert err["code"] == "context_length_exceeded"


def test_invalid_tool_schema(http: httpx.Client) -> None:
    bad_name = [{"type": "function", "function": {"name": "no spaces allowed"}}]
    assert _error(http, 400, chat_body(tools=bad_name))["param"].startswith("tools")
    bad_params = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    assert "object" in _error(http, 400, chat_body(tools=bad_params))["message"]
    assert _error(http, 400, chat_body(tools=[{"type": "retrieval"}]))["param"].startswith("tools")


def test_impossible_structured_output_is_stated(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    named = {"type": "function", "function": {"name": "g"}}
    err = _error(http, 400, chat_body(tools=tools, tool_choice=named))
    assert "not among the tools" in err["message"] and err["param"] == "tool_choice"
    err = _error(http, 400, chat_body(tool_choice="required"))
    assert err["param"] == "tool_choice"
    err = _error(http, 400, chat_body(response_format={"type": "yaml"}))
    assert err["param"] == "response_format"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}
    assert _error(http, 400, chat_body(response_format=bad_schema))["param"] == "response_format"
    lookbehind = {"type": "string", "pattern": "(?<=a)b"}
    unsupported = {"type": "json_schema", "json_schema": {"name": "x", "schema": lookbehind}}
    err = _error(http, 400, chat_body(response_format=unsupported))
    assert "look-around" in err["message"] and err["param"] == "response_format"


def test_unknown_model_is_served_and_unknown_route_404s(http: httpx.Client) -> None:
    # One model is served: another name is served too (--strict-model-name refuses it).
    response = http.post("/v1/chat/completions", json=chat_body(model="other", max_tokens=1))
    assert response.status_code == 200 and response.json()["model"] == MODEL
    assert_error_shape(http.get("/v1/nothing"), 404)
    assert_error_shape(http.get("/v1/chat/completions"), 405)


def test_body_size_limit(http: httpx.Client) -> None:
    huge = chat_body(content="x" * (100 * 1024))
    err = _error(
        http, 413, content=json.dumps(huge).encode(), headers={"content-type": "application/json"}
    )
    assert err["code"] == "body_too_large"


def test_completions_errors(http: httpx.Client) -> None:
    """A bad prompt is named as the completions client wrote it: `prompt`."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 10**9]})
    assert_error_shape(r, 400)
    assert r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ""})
    assert_error_shape(r, 400)
    assert r.json()["error"]["param"] == "prompt"
    _serves_normally(http)


def _open_stream(http: httpx.Client, body: dict[str, Any]) -> tuple[Any, Any, str]:
    """Start a stream and read its first event; return (context, response, request id)."""
    ctx = http.stream("POST", "/v1/chat/completions", json=body)
    response = ctx.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    return ctx, lines, json.loads(first[6:])["id"]


def _wait_status(server: ServerThread, rid: str, timeout: float = 20.0) -> RequestStatus | None:
    engine: Any = server.state.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = engine.request_status(rid)
        if status is not None and status.is_finished:
            return status
        time.sleep(0.02)
    return engine.request_status(rid)


def test_overload_answers_429_with_retry_after(server: ServerThread, http: httpx.Client) -> None:
    long = chat_body(max_tokens=4000, stream=True)
    # Keep the line iterators: dropping one closes its connection (a disconnect).
    running, lines_a, rid_a = _open_stream(http, long)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as other:
        waiting, lines_b, rid_b = _open_stream(other, long)
        try:
            r = http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            err = assert_error_shape(r, 429)
            assert r.headers.get("retry-after") == "1" and err["type"] == "rate_limit_error"
        finally:
            waiting.__exit__(None, None, None)
            running.__exit__(None, None, None)
            del lines_a, lines_b
    assert _wait_status(server, rid_a) == RequestStatus.FINISHED_ABORTED
    assert _wait_status(server, rid_b) == RequestStatus.FINISHED_ABORTED
    _serves_normally(http)


def test_stream_disconnect_aborts_and_frees_the_slot(
    server: ServerThread, http: httpx.Client
) -> None:
    engine: Any = server.state.engine
    ctx, lines, rid = _open_stream(http, chat_body(max_tokens=4000, stream=True))
    for _ in range(5):
        next(lines)
    ctx.__exit__(None, None, None)
    assert _wait_status(server, rid) == RequestStatus.FINISHED_ABORTED
    generated = engine.stats()["generation_tokens"]
    # max-num-seqs is 1: the next request runs only if the slot was freed, and once it
    # is done every token since the abort is its own.
    _serves_normally(http)
    assert engine.stats()["running"] == 0
    assert engine.stats()["generation_tokens"] == generated + 3, "tokens generated after abort"


def test_non_stream_disconnect_aborts(server: ServerThread, http: httpx.Client) -> None:
    seen: list[str] = []
    server.state.on_submit = lambda rid, _ids: seen.append(rid)
    try:
        with (
            httpx.Client(base_url=server.url, headers=AUTH, timeout=1.0) as impatient,
            pytest.raises(httpx.ReadTimeout),
        ):
            impatient.post("/v1/chat/completions", json=chat_body(max_tokens=4000))
    finally:
        server.state.on_submit = None
    assert len(seen) == 1
    assert _wait_status(server, seen[0]) == RequestStatus.FINISHED_ABORTED
    _serves_normally(http)


def test_metrics_count_errors(server: ServerThread, http: httpx.Client) -> None:
    text = http.get("/metrics").text
    assert metric(text, "mlxserve_requests_total", endpoint="chat", outcome="400")
    assert metric(text, "mlxserve_requests_total", endpoint="chat", outcome="aborted")
