"""Aborts are owned from submit: an exception anywhere between a request's submit and
its response's first byte aborts the engine request, on every route, streamed or not.

The oracle: each request asks for far more tokens than the test waits for, so a
request left running would keep the engine busy; the engine must be idle again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, serve_args
from engine_helpers import idle, wait_until

from mlxserve.api import writer
from mlxserve.api.anthropic import routes as anthropic_routes
from mlxserve.api.openai import routes as openai_routes
from mlxserve.api.responses import routes as responses_routes
from mlxserve.models import load

pytestmark = pytest.mark.slow

LONG = 50_000
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": LONG,
    },
    "/v1/completions": {"model": "m", "prompt": "Hi", "max_tokens": LONG},
    "/v1/messages": {
        "model": "m",
        "max_tokens": LONG,
        "messages": [{"role": "user", "content": "Hi"}],
    },
    "/v1/responses": {"model": "m", "input": "Hi", "max_output_tokens": LONG},
}


def _raise(*_: Any, **__: Any) -> Any:
    raise RuntimeError("injected after submit")


# (route, the name patched to raise: a point between submit and the first byte)
POINTS = [
    ("/v1/chat/completions", openai_routes, "_writer"),
    ("/v1/completions", openai_routes, "respond"),
    ("/v1/messages", anthropic_routes, "MessageMeta"),
    ("/v1/messages", writer, "_GuardedStream"),
    ("/v1/responses", responses_routes, "ResponseShell"),
    ("/v1/responses", responses_routes, "_token_counter"),
]


@pytest.fixture(scope="module")
def srv(model_dir_factory) -> Iterator[ServerThread]:
    path = model_dir_factory("llama")
    with ServerThread(serve_args(), lambda: load(path)) as server:
        yield server


def _post(srv: ServerThread, route: str, stream: bool) -> httpx.Response:
    body = {**BODIES[route], "stream": stream}
    return httpx.post(srv.url + route, json=body, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", list(BODIES))
def test_a_failure_right_after_submit_aborts_the_request(
    srv: ServerThread, route: str, stream: bool
) -> None:
    srv.state.on_submit = _raise
    try:
        response = _post(srv, route, stream)
    finally:
        srv.state.on_submit = None
    assert response.status_code == 500
    assert wait_until(lambda: idle(srv.state.engine), timeout=60)  # type: ignore[arg-type]


# Only the streamed answer builds a stream.
CASES = [
    (*point, stream)
    for point in POINTS
    for stream in (False, True)
    if stream or point[2] != "_GuardedStream"
]


@pytest.mark.parametrize(("route", "owner", "name", "stream"), CASES)
def test_a_failure_while_building_the_response_aborts_the_request(
    srv: ServerThread, route: str, owner: Any, name: str, stream: bool, monkeypatch
) -> None:
    monkeypatch.setattr(owner, name, _raise)
    response = _post(srv, route, stream)
    monkeypatch.undo()
    assert response.status_code == 500
    assert wait_until(lambda: idle(srv.state.engine), timeout=60)  # type: ignore[arg-type]
    # The server goes on serving.
    limit = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
    ok = httpx.post(srv.url + route, json={**BODIES[route], limit: 16}, timeout=60)
    assert ok.status_code == 200
