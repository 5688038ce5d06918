"""Bad Anthropic requests get a 4xx in Anthropic's error shape; the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, serve_args
from image_helpers import anthropic_image, png

from mlxserve.models import load
from mlxserve.models.tiny.scripted import write_checkpoint

pytestmark = pytest.mark.slow

MODEL = "scripted-v4"
GOOD: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "Hi"}],
}
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = write_checkpoint(tmp_path_factory.mktemp("scripted"), ["Hm.</think>Hello."])
    args = serve_args("--served-model-name", MODEL, "--max-model-len", "4096", model=str(path))
    with ServerThread(args, lambda: load(path)) as server:
        yield server


def _with(**fields: Any) -> dict[str, Any]:
    body = dict(GOOD)
    for key, value in fields.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def _user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


BAD: list[tuple[str, Any, str]] = [
    ("missing max_tokens", _with(max_tokens=None), "max_tokens"),
    ("missing messages", _with(messages=None), "messages"),
    ("empty messages", _with(messages=[]), "messages"),
    ("max_tokens a string", _with(max_tokens="16"), "max_tokens"),
    ("max_tokens zero", _with(max_tokens=0), "max_tokens"),
    ("unknown role", _with(messages=[{"role": "tool", "content": "x"}]), "role"),
    ("content a number", _with(messages=[{"role": "user", "content": 5}]), "content"),
    ("unknown block type", _with(messages=[_user({"type": "video", "x": 1})]), "video"),
    ("block without type", _with(messages=[_user({"text": "hi"})]), "type"),
    ("text not a string", _with(messages=[_user({"type": "text", "text": 3})]), "text"),
    (
        "image on a text-only model",
        _with(messages=[_user(anthropic_image(png()))]),
        "text only",
    ),
    (
        "image without data",
        _with(messages=[_user({"type": "image", "source": {"type": "base64", "data": ""}})]),
        "non-empty base64",
    ),
    (
        "document on a text-only model",
        _with(messages=[_user({"type": "document", "source": {}})]),
        "text only",
    ),
    (
        "tool_result without its tool_use",
        _with(messages=[_user({"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"})]),
        "tool_use",
    ),
    (
        "tool_result naming another call",
        _with(
            messages=[
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [TOOL_USE]},
                _user({"type": "tool_result", "tool_use_id": "toolu_2", "content": "1"}),
            ]
        ),
        "toolu_2",
    ),
    (
        "tool_use in a user turn",
        _with(messages=[_user(TOOL_USE)]),
        "tool_use",
    ),
    (
        "tool_use input not an object",
        _with(
            messages=[
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{**TOOL_USE, "input": "[]"}]},
                {"role": "user", "content": "again"},
            ]
        ),
        "input",
    ),
    (
        "assistant prefill",
        _with(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}]),
        "prefill",
    ),
    ("only a system message", _with(messages=[{"role": "system", "content": "s"}]), "user"),
    ("system not text", _with(system=[{"type": "image"}]), "system"),
    ("tools not a list", _with(tools={"name": "f"}), "tools"),
    ("tool_choice unknown", _with(tool_choice={"type": "sometimes"}), "tool_choice"),
    (
        "tool_choice names a missing tool",
        _with(
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "g"},
        ),
        "'g'",
    ),
    ("tool_choice any without tools", _with(tool_choice={"type": "any"}), "tools"),
    ("thinking type unknown", _with(thinking={"type": "maybe"}), "thinking"),
    ("temperature a string", _with(temperature="hot"), "temperature"),
    ("stop_sequences not a list", _with(stop_sequences="END"), "stop_sequences"),
    ("unknown effort", _with(output_config={"effort": "ludicrous"}), "effort"),
    (
        "prompt past the context",
        _with(messages=[{"role": "user", "content": "go " * 5000}]),
        "4096",
    ),
]


@pytest.mark.parametrize(
    ("body", "needle"), [(b, n) for _, b, n in BAD], ids=[i for i, _, _ in BAD]
)
def test_bad_request_is_a_shaped_400(srv: ServerThread, body: Any, needle: str) -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        response = http.post("/v1/messages", json=body)
        assert response.status_code == 400, response.text
        payload = response.json()
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "invalid_request_error"
        assert needle.lower() in payload["error"]["message"].lower(), payload
        assert http.post("/v1/messages", json=GOOD).status_code == 200


def test_malformed_json_and_wrong_method(srv: ServerThread) -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        bad = http.post(
            "/v1/messages", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert bad.status_code == 400 and bad.json()["type"] == "error"
        wrong = http.get("/v1/messages")
        assert wrong.status_code == 405 and wrong.json()["type"] == "error"
        missing = http.post("/v1/messages/batches", json=GOOD)
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "not_found_error"
        # The OpenAI routes keep their own shape.
        openai_shape = http.post("/v1/chat/completions", json={"messages": []}).json()
        assert set(openai_shape) == {"error"} and "param" in openai_shape["error"]


def test_count_tokens_errors_are_shaped(srv: ServerThread) -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        response = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": []})
        assert response.status_code == 400 and response.json()["type"] == "error"
        ok = http.post(
            "/v1/messages/count_tokens", json={"model": MODEL, "messages": GOOD["messages"]}
        )
        assert ok.status_code == 200 and ok.json()["input_tokens"] > 0


def test_stop_sequence_ends_with_stop_reason(srv: ServerThread) -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        body = _with(stop_sequences=["llo"])
        message = http.post("/v1/messages", json=body).json()
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == "llo"
    assert message["content"][-1] == {"type": "text", "text": "He"}


def test_max_tokens_stop_reason(srv: ServerThread) -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        message = http.post("/v1/messages", json=_with(max_tokens=2)).json()
    assert message["stop_reason"] == "max_tokens"
    assert message["usage"]["output_tokens"] == 2


def test_disabled_thinking_selects_chat_mode(srv: ServerThread) -> None:
    seen: list[list[int]] = []
    srv.state.on_submit = lambda _rid, ids: seen.append(ids)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            http.post("/v1/messages", json=_with(thinking={"type": "disabled"}))
            http.post(
                "/v1/messages", json=_with(thinking={"type": "enabled", "budget_tokens": 1024})
            )
    finally:
        srv.state.on_submit = None
    tokenizer = srv.state.engine.model.tokenizer
    assert tokenizer.decode(seen[0]).endswith("<｜Assistant｜></think>")
    assert tokenizer.decode(seen[1]).endswith("<｜Assistant｜><think>")


def test_script_path_checkpoint_loads_through_the_cli(tmp_path: Path) -> None:
    from mlxserve.cli import main

    out = tmp_path / "ck"
    assert (
        main(["make-model", str(out), "--family", "scripted", "--script", "a", "--script", "b"])
        == 0
    )
    loaded = load(out)
    assert loaded.extra["scripted"] and len(loaded.extra["scripts"]) == 2
    assert main(["make-model", str(tmp_path / "x"), "--family", "scripted"]) == 2


def test_stream_disconnect_aborts_the_request(tmp_path: Path) -> None:
    import json as json_module
    import time

    from mlxserve.engine.request import RequestStatus

    path = write_checkpoint(tmp_path, ["Hm.</think>" + "tick " * 3000])
    args = serve_args("--served-model-name", MODEL, "--max-num-seqs", "1", model=str(path))
    with (
        ServerThread(args, lambda: load(path)) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        engine: Any = server.state.engine
        body = _with(max_tokens=4000, stream=True)
        with http.stream("POST", "/v1/messages", json=body) as response:
            lines = response.iter_lines()
            start = next(line for line in lines if line.startswith("data: "))
            rid = json_module.loads(start[6:])["message"]["id"]
            for _ in range(20):
                next(lines)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status = engine.request_status(rid)
            if status is not None and status.is_finished:
                break
            time.sleep(0.02)
        assert engine.request_status(rid) == RequestStatus.FINISHED_ABORTED
        assert engine.stats()["running"] == 0
        # One slot: the next request runs only because the aborted one freed it.
        assert http.post("/v1/messages", json=_with(max_tokens=3)).status_code == 200
