"""Bad images never hurt anyone else: each kind of bad image input, on each dialect that
can carry it, is a 400 in that dialect's shape naming the part, while a stream that was
already running finishes with exactly the tokens it gets alone; then random and mangled
image bytes, and the server still serves."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, assert_error_shape, metric, scripted_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from image_helpers import b64, encoded, png, png_header, truncated_png

pytestmark = pytest.mark.slow

MODEL = "scripted-v4"
WORDS = " ".join(f"word{i}" for i in range(120))
SCRIPT = f"Thinking.</think>{WORDS}"
MAX_IMAGES = 3
GOOD = b64(png())

# A kind of bad input: its image sources, each ("b64", data, media type), ("url", url)
# or ("file", id). The last source is the part the error must name.
Source = tuple[Any, ...]
KINDS: dict[str, list[Source]] = {
    "not base64": [("b64", "@@ not base64 @@", "image/png")],
    "not an image": [("b64", b64(b"just some text, no pixels"), "image/png")],
    "truncated": [("b64", b64(truncated_png()), "image/png")],
    "zero-sized": [("b64", b64(png_header(0, 7)), "image/png")],
    "decompression bomb": [("b64", b64(png_header(100_000, 100_000)), "image/png")],
    "over --max-image-pixels": [("b64", b64(png((120, 120))), "image/png")],
    "too many images": [("b64", GOOD, "image/png")] * (MAX_IMAGES + 1),
    "unsupported media type": [("b64", b64(encoded("BMP")), "image/bmp")],
    "undeclared unsupported bytes": [("b64", b64(encoded("BMP")), "")],
    "type disagrees with bytes": [("b64", b64(encoded("JPEG")), "image/png")],
    "remote https URL": [("url", "https://example.com/cat.png")],
    "metadata address": [("url", "http://169.254.169.254/latest/meta-data")],
    "file scheme": [("url", "file:///etc/passwd")],
    "bare path": [("url", "shot.png")],
    "empty data URL": [("b64", "", "image/png")],
    "file id": [("file", "file_123")],
}


def _url(source: Source) -> Any:
    if source[0] == "url":
        return source[1]
    return f"data:{source[2]};base64,{source[1]}"


def _chat(sources: list[Source]) -> tuple[dict[str, Any], str] | None:
    if any(s[0] == "file" for s in sources):
        return None  # chat completions has no file-id image part
    parts: list[Any] = [{"type": "text", "text": "look"}]
    parts += [
        {"type": "image_url", "image_url": {"url": _url(s), "detail": "high"}} for s in sources
    ]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    return body, f"messages[1].content[{len(sources)}]"


def _anthropic_source(source: Source) -> dict[str, Any]:
    if source[0] == "url":
        return {"type": "url", "url": source[1]}
    if source[0] == "file":
        return {"type": "file", "file_id": source[1]}
    return {"type": "base64", "media_type": source[2], "data": source[1]}


def _messages(sources: list[Source]) -> tuple[dict[str, Any], str]:
    """Claude Code's `Read` of a PNG: the images inside a tool_result."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
    content: list[Any] = [{"type": "text", "text": "a.png"}]
    content += [{"type": "image", "source": _anthropic_source(s)} for s in sources]
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
    messages = [
        {"role": "user", "content": "read a.png"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    body = {"model": MODEL, "max_tokens": 4, "messages": messages}
    return body, f"messages[2].content[0].content[{len(sources)}]"


def _responses(sources: list[Source]) -> tuple[dict[str, Any], str]:
    parts: list[Any] = [{"type": "input_text", "text": "look"}]
    for s in sources:
        part = {"type": "input_image", "file_id": s[1]} if s[0] == "file" else {}
        parts.append(part or {"type": "input_image", "image_url": _url(s), "detail": "low"})
    body = {"model": MODEL, "input": [{"role": "user", "content": parts}], "max_output_tokens": 4}
    return body, f"input[0].content[{len(sources)}]"


def _openai_checked(response: httpx.Response, where: str) -> None:
    err = assert_error_shape(response, 400)
    assert err["param"] == where and err["message"].startswith(where + ": "), err
    assert err["code"] != "model_reads_text_only", err


def _anthropic_checked(response: httpx.Response, where: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(where + ": "), body
    assert "reads text only" not in body["error"]["message"], body


Check = Callable[[httpx.Response, str], None]
ROUTES: list[tuple[str, Callable[[list[Source]], Any], Check]] = [
    ("/v1/chat/completions", _chat, _openai_checked),
    ("/v1/messages", _messages, _anthropic_checked),
    ("/v1/responses", _responses, _openai_checked),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    extra = ("--max-images-per-request", str(MAX_IMAGES), "--max-image-pixels", "10000")
    with scripted_server(SCRIPT, *extra) as srv:
        yield srv


def _stream_text(lines: Iterator[str]) -> str:
    """Every reasoning and content piece of an OpenAI chat stream, in order."""
    out = []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            delta = choice.get("delta", {})
            out.append((delta.get("reasoning_content") or "") + (delta.get("content") or ""))
    return "".join(out)


STREAM_BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Count for me."}],
    "max_tokens": 400,
    "stream": True,
}


def test_each_kind_of_bad_image_is_a_400_while_a_stream_runs(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as solo:
            alone = _stream_text(solo.iter_lines())
        assert alone == SCRIPT.replace("</think>", "")
        checked: list[str] = []
        with client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as running:
            lines = running.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            for kind, sources in KINDS.items():
                for path, build, check in ROUTES:
                    built = build(sources)
                    if built is None:
                        continue
                    body, where = built
                    check(client.post(path, json=body), where)
                    checked.append(f"{kind} {path}")
            rest = _stream_text(iter([first, *lines]))
        assert rest == alone
    assert len(KINDS) >= 12 and len(checked) >= 3 * len(KINDS) - 1
    scrape = httpx.get(server.url + "/metrics").text
    # Every kind but a file id (refused as the part is read) and too many images.
    assert metric(scrape, "mlxserve_images_total", outcome="invalid") == 3 * (len(KINDS) - 2)
    assert (metric(scrape, "mlxserve_images_total", outcome="over_limit") or 0) == 3 * 4


MAGIC = [b"", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"\xff\xd8\xff", b"RIFF\x10\0\0\0WEBPVP8 "]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    route=st.integers(0, 2),
    magic=st.sampled_from(MAGIC),
    tail=st.binary(max_size=48),
    cut=st.integers(1, 200),
    mangle=st.booleans(),
)
def test_random_and_mangled_image_bytes_get_a_400_in_shape(
    server: ServerThread, route: int, magic: bytes, tail: bytes, cut: int, mangle: bool
) -> None:
    """Random bytes behind an image signature, or a real PNG cut short: always a 400 (a bad
    image, or a good one refused by this text-only model), never a 5xx."""
    data = png((16, 16))[:cut] if mangle else magic + tail
    path, build, _ = ROUTES[route]
    body, _ = build([("b64", b64(data), "image/png")])
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    if path == "/v1/messages":
        assert response.json()["type"] == "error"
    else:
        assert_error_shape(response, 400)


def test_still_serves_after_the_fuzz(server: ServerThread) -> None:
    body = {**STREAM_BODY, "stream": False, "max_tokens": 8}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
