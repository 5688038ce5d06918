"""Random malformed requests never crash the server: a 4xx in the OpenAI shape, or a 200."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, assert_error_shape, chat_body, serve_args
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxserve.models.tiny.scripted import scripted_model

pytestmark = pytest.mark.slow

FIELDS = [
    "messages",
    "tools",
    "tool_choice",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "reasoning_effort",
    "chat_template_kwargs",
    "parallel_tool_calls",
    "stream",
    "stream_options",
    "n",
    "response_format",
    "model",
]
MESSAGE_FIELDS = ["role", "content", "tool_calls", "tool_call_id", "reasoning_content", "name"]

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
def server() -> Iterator[ServerThread]:
    args = serve_args("--served-model-name", "test-model", "--max-model-len", "4096")
    with ServerThread(args, lambda: scripted_model("ok")) as srv:
        yield srv


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_error_shape(response, response.status_code)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    field=st.sampled_from(FIELDS),
    value=json_values,
    message_field=st.sampled_from(MESSAGE_FIELDS),
    message_value=json_values,
    in_message=st.booleans(),
)
def test_mutated_chat_requests_get_clean_answers(
    server: ServerThread,
    field: str,
    value: Any,
    message_field: str,
    message_value: Any,
    in_message: bool,
) -> None:
    body: dict[str, Any] = chat_body(max_tokens=2)
    if in_message:
        body["messages"][0][message_field] = message_value
    else:
        body[field] = value
    with httpx.Client(base_url=server.url, timeout=30) as client:
        _check(client.post("/v1/chat/completions", content=json.dumps(body)))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_garbage_bodies_get_clean_answers(server: ServerThread, raw: bytes) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path in ("/v1/chat/completions", "/v1/completions"):
            _check(client.post(path, content=raw))


def test_still_serves_after_the_fuzz(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("knob", "value", "status"),
    [
        ("top_k", 129280, 200),  # the whole vocabulary: no filtering
        ("top_k", 10**12, 200),
        ("top_k", -1, 200),  # vLLM's "disabled"
        ("top_k", -2, 400),
        ("seed", -1, 200),
        ("seed", 2**64 - 1, 200),
        ("seed", 2**64, 400),
        ("seed", -(2**63) - 1, 400),
    ],
)
def test_sampling_knobs_at_their_limits(
    server: ServerThread, knob: str, value: int, status: int
) -> None:
    body = chat_body(max_tokens=2, temperature=1.0, **{knob: value})
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=body)
    if status == 200:
        assert response.status_code == 200, response.text
    else:
        assert knob in assert_error_shape(response, status)["message"]
