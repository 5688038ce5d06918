"""Random malformed Messages requests: a 4xx in Anthropic's shape or a 200, never a crash."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, serve_args
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxserve.models import load
from mlxserve.models.tiny.scripted import write_checkpoint

pytestmark = pytest.mark.slow

FIELDS = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "thinking",
    "output_config",
    "stream",
    "metadata",
    "context_management",
]
MESSAGE_FIELDS = ["role", "content"]
BLOCK_FIELDS = ["type", "text", "id", "name", "input", "tool_use_id", "content", "thinking"]
BLOCK_TYPES = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "x"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path: Path = write_checkpoint(tmp_path_factory.mktemp("fuzz"), ["Hm.</think>ok"])
    args = serve_args("--served-model-name", "m", "--max-model-len", "4096", model=str(path))
    with ServerThread(args, lambda: load(path)) as srv:
        yield srv


def _body() -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert body["type"] == "error", body
        assert isinstance(body["error"]["type"], str) and body["error"]["message"], body


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    where=st.sampled_from(["top", "message", "block"]),
    field=st.sampled_from(FIELDS),
    message_field=st.sampled_from(MESSAGE_FIELDS),
    block_field=st.sampled_from(BLOCK_FIELDS),
    block_type=st.sampled_from(BLOCK_TYPES),
    index=st.integers(0, 2),
    value=json_values,
)
def test_mutated_messages_requests_get_clean_answers(
    server: ServerThread,
    where: str,
    field: str,
    message_field: str,
    block_field: str,
    block_type: str,
    index: int,
    value: Any,
) -> None:
    body = _body()
    message = body["messages"][index]
    if where == "top":
        body[field] = value
    elif where == "message":
        message[message_field] = value
    elif isinstance(message["content"], list):
        block = message["content"][0]
        block["type"] = block_type
        block[block_field] = value
    with httpx.Client(base_url=server.url, timeout=30) as client:
        _check(client.post("/v1/messages", content=json.dumps(body)))


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_garbage_bodies_get_clean_answers(server: ServerThread, raw: bytes) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            _check(client.post(path, content=raw))


def test_a_top_k_past_the_vocabulary_keeps_every_token(server: ServerThread) -> None:
    body = {**_body(), "max_tokens": 2, "temperature": 1.0, "top_k": 10**12}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/v1/messages", content=json.dumps(body))
    assert response.status_code == 200, response.text


def test_still_serves_after_the_fuzz(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/v1/messages", json={**_body(), "max_tokens": 32})
    assert response.status_code == 200, response.text
    assert response.json()["content"][-1] == {"type": "text", "text": "ok"}
