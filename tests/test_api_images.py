"""Images over HTTP on all three dialects, through the official clients.

Every model served today reads text only: by default an image is a 400 in the route's
own shape that names the model and the part; with `--images-for-text-models
placeholder` each image becomes a short note in the prompt (the scripted DeepSeek-V4
model shows what was rendered), the same request renders the same tokens, and the
second is a prefix-cache hit: an agent session that once held a screenshot goes on.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from api_fixtures import ServerThread, free_port, metric, scripted_server
from image_helpers import (
    anthropic_image,
    data_url,
    encoded,
    openai_image,
    png,
    responses_image,
    truncated_png,
)

from mlxserve.api.serve import build_app
from mlxserve.cli import build_parser
from mlxserve.models.tiny.scripted import write_checkpoint

pytestmark = pytest.mark.slow

MODEL = "scripted-v4"
ANSWER = "It is a red square."
SCRIPT = f"Looked.</think>{ANSWER}"
SHOT = png((640, 480))
NOTE = "[image: image/png, 640x480, not shown: this model reads text only]"
CALL = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "shot.png"}}


@pytest.fixture(scope="module")
def refusing() -> Iterator[ServerThread]:
    with scripted_server(SCRIPT) as srv:
        yield srv


@pytest.fixture(scope="module")
def placing() -> Iterator[ServerThread]:
    with scripted_server(SCRIPT, "--images-for-text-models", "placeholder") as srv:
        yield srv


def _openai(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)


def _anthropic(srv: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)


def _chat_messages(url: str) -> list[Any]:
    text = {"type": "text", "text": "What is in this picture?"}
    return [{"role": "user", "content": [text, openai_image(url)]}]


def _responses_input(url: str) -> list[Any]:
    text = {"type": "input_text", "text": "What is in this picture?"}
    return [{"role": "user", "content": [text, responses_image(url)]}]


def _read_turn(shot: bytes = SHOT) -> list[dict[str, Any]]:
    """Claude Code's shape: `Read` on a PNG answers with an image inside the tool_result."""
    result = {"type": "tool_result", "tool_use_id": CALL["id"], "content": [anthropic_image(shot)]}
    return [
        {"role": "user", "content": "Look at shot.png"},
        {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [result]},
    ]


def _capture(srv: ServerThread) -> list[list[int]]:
    seen: list[list[int]] = []
    srv.state.on_submit = lambda _rid, ids: seen.append(list(ids))
    return seen


def _text(srv: ServerThread, ids: list[int]) -> str:
    return str(srv.state.engine.model.tokenizer.decode(ids))


def test_every_route_refuses_an_image_for_a_text_model_by_default(refusing: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        _openai(refusing).chat.completions.create(
            model=MODEL, messages=_chat_messages(data_url(SHOT)), max_tokens=8
        )
    error = chat.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_reads_text_only" and error["param"] == "messages[0].content[1]"
    assert f"'{MODEL}' reads text only" in error["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        _openai(refusing).responses.create(model=MODEL, input=_responses_input(data_url(SHOT)))
    assert isinstance(responses.value.body, dict)
    assert responses.value.body["param"] == "input[0].content[1]"
    with pytest.raises(anthropic.BadRequestError) as messages:
        _anthropic(refusing).messages.create(model=MODEL, max_tokens=8, messages=_read_turn())
    body = messages.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages[2].content[0].content[0]: ")
    assert "reads text only" in body["error"]["message"]
    scrape = httpx.get(refusing.url + "/metrics").text
    assert metric(scrape, "mlxserve_images_total", outcome="refused", model_name=MODEL) == 3


def test_count_tokens_counts_an_image_as_its_note(refusing: ServerThread) -> None:
    client = _anthropic(refusing)

    def count(first: dict[str, Any]) -> int:
        content = [first, {"type": "text", "text": "What is it?"}]
        messages: Any = [{"role": "user", "content": content}]
        return client.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    with_image = count(anthropic_image(SHOT))
    assert with_image == count({"type": "text", "text": NOTE})
    assert with_image > count({"type": "text", "text": ""})
    with pytest.raises(anthropic.BadRequestError) as bad:
        count(anthropic_image(truncated_png()))
    message = bad.value.response.json()["error"]["message"]
    assert message.startswith("messages[0].content[0]: ") and "truncated" in message


def test_chat_completions_render_the_note_and_answer(placing: ServerThread) -> None:
    seen = _capture(placing)
    try:
        reply = _openai(placing).chat.completions.create(
            model=MODEL, messages=_chat_messages(data_url(SHOT)), max_tokens=32, temperature=0
        )
    finally:
        placing.state.on_submit = None
    assert reply.choices[0].message.content == ANSWER
    assert "What is in this picture?\n" + NOTE in _text(placing, seen[0])


def test_responses_render_the_note_and_answer(placing: ServerThread) -> None:
    seen = _capture(placing)
    gif = encoded("GIF", (9, 7))
    try:
        reply = _openai(placing).responses.create(
            model=MODEL, input=_responses_input(data_url(gif, "image/gif")), max_output_tokens=32
        )
    finally:
        placing.state.on_submit = None
    assert reply.output_text == ANSWER
    note = "[image: image/gif, 9x7, not shown: this model reads text only]"
    assert note in _text(placing, seen[0])


def test_a_read_tool_result_with_an_image_goes_on_and_hits_the_cache(placing: ServerThread) -> None:
    """The same request twice renders the same tokens, and the second reuses the first's
    cache; the next turn, re-sending the screenshot, extends that prompt and hits too."""
    client = _anthropic(placing)
    seen = _capture(placing)
    try:
        first = client.messages.create(model=MODEL, max_tokens=32, messages=_read_turn())
        again = client.messages.create(model=MODEL, max_tokens=32, messages=_read_turn())
        history = [
            *_read_turn(),
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": "And now?"},
        ]
        later = client.messages.create(model=MODEL, max_tokens=32, messages=history)
    finally:
        placing.state.on_submit = None
    assert [b.type for b in first.content] == ["thinking", "text"]
    assert first.content[1].text == ANSWER  # type: ignore[union-attr]
    assert NOTE in _text(placing, seen[0]) and seen[0] == seen[1]
    assert (again.usage.cache_read_input_tokens or 0) > 0
    # (The first prompt's last token opens its reasoning; history renders it closed.)
    assert seen[2][: len(seen[0]) - 1] == seen[0][:-1]
    assert (later.usage.cache_read_input_tokens or 0) >= len(seen[0]) - 1


def test_chat_twice_is_a_cache_hit_and_metrics_count_the_notes(placing: ServerThread) -> None:
    client = _openai(placing)
    before = httpx.get(placing.url + "/metrics").text
    counted = metric(before, "mlxserve_images_total", outcome="placeholder") or 0.0
    webp = data_url(encoded("WEBP", (5, 5)), "image/webp")
    for _ in range(2):
        reply = client.chat.completions.create(
            model=MODEL, messages=_chat_messages(webp), max_tokens=32, temperature=0
        )
    details = reply.usage.prompt_tokens_details if reply.usage else None
    assert details is not None and (details.cached_tokens or 0) > 0
    after = httpx.get(placing.url + "/metrics").text
    assert metric(after, "mlxserve_images_total", outcome="placeholder") == counted + 2


def test_the_text_model_mode_is_per_model_in_a_models_config(tmp_path: Path) -> None:
    paths = [write_checkpoint(tmp_path / name, [SCRIPT]) for name in ("a", "b")]
    config = tmp_path / "models.toml"
    config.write_text(
        f'[[model]]\nname = "a"\npath = "{paths[0]}"\nimages_for_text_models = "placeholder"\n'
        f'[[model]]\nname = "b"\npath = "{paths[1]}"\n'
    )
    argv = ["serve", "--models-config", str(config), "--port", str(free_port())]
    _, served = build_app(build_parser().parse_args([*argv, "--max-images-per-request", "3"]))
    policies = {state.model_name: state.image_policy for state in served.models}
    assert policies["a"].text_models == "placeholder" and policies["b"].text_models == "refuse"
    assert policies["a"].limits.max_images == policies["b"].limits.max_images == 3
    config.write_text(config.read_text().replace('"placeholder"', '"sometimes"'))
    with pytest.raises(ValueError, match="images_for_text_models"):
        build_app(build_parser().parse_args(argv))


def test_the_readme_image_example_answers_in_placeholder_mode(placing: ServerThread) -> None:
    from test_readme import sh_commands

    (command,) = [c for c in sh_commands() if c.startswith("curl ") and "image_url" in c]
    argv = shlex.split(command.replace("127.0.0.1:8000", f"127.0.0.1:{placing.args.port}"))
    seen = _capture(placing)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    finally:
        placing.state.on_submit = None
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["choices"][0]["message"]["content"] == ANSWER, body
    assert "[image: image/png, 2x2, not shown: this model reads text only]" in _text(
        placing, seen[0]
    )
