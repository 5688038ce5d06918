"""Images over HTTP to the tiny LLaVA checkpoint, on all three dialects.

Each route's answer to an image prompt is mlx-vlm's own greedy generation for the prompt
the server rendered; Claude Code's shape (an image inside a `tool_result`) re-sent is a
prefix-cache hit that covers the image, a different screenshot is not; /metrics counts
the images and the vision tower's time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from api_fixtures import ServerThread, metric, serve_args
from image_helpers import anthropic_image, data_url, openai_image, responses_image
from vision_helpers import Oracle, noise_png

from mlxserve.models.loaded import LoadedModel
from mlxserve.models.tiny.vision import IMAGE_TOKEN_ID, IMAGE_TOKENS
from mlxserve.models.vision import IMAGE_KEY_BASE

MODEL = "tiny-llava"
MAX_TOKENS = 5
SHOT = noise_png(3)
OTHER = noise_png(4)
GREEDY = {"temperature": 0}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "shot.png"}}


@pytest.fixture(scope="module")
def server(vision_dir: Path, vision_model: LoadedModel) -> Iterator[ServerThread]:
    args = serve_args("--served-model-name", MODEL, model=str(vision_dir))
    with ServerThread(args, lambda: vision_model) as srv:
        yield srv


def _capture(srv: ServerThread) -> list[list[int]]:
    seen: list[list[int]] = []
    srv.state.on_submit = lambda _rid, ids: seen.append(list(ids))
    return seen


def _expected_text(srv: ServerThread, oracle: Oracle, ids: list[int], image: bytes) -> str:
    """mlx-vlm's answer to the prompt the server submitted: its text is the submitted ids
    with the image's keyed span folded back into one placeholder."""
    span = [i for i, t in enumerate(ids) if t >= IMAGE_KEY_BASE]
    assert len(span) == IMAGE_TOKENS
    tokenizer = srv.state.engine.model.tokenizer
    text = tokenizer.decode(ids[: span[0]] + [IMAGE_TOKEN_ID] + ids[span[-1] + 1 :])
    return str(tokenizer.decode(oracle.tokens(text, [image], MAX_TOKENS)))


def _read_turn(shot: bytes) -> list[dict[str, Any]]:
    """Claude Code's shape: `Read` on a PNG answers with an image inside the tool_result."""
    result = {"type": "tool_result", "tool_use_id": CALL["id"], "content": [anthropic_image(shot)]}
    return [
        {"role": "user", "content": "Look at shot.png"},
        {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [result]},
    ]


def test_every_route_answers_as_mlx_vlm_does(server: ServerThread, oracle: Oracle) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    question = {"type": "text", "text": "What is in this picture?"}
    chat: Any = [{"role": "user", "content": [question, openai_image(data_url(SHOT))]}]
    seen = _capture(server)
    try:
        reply = client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=MAX_TOKENS, temperature=0
        )
        stream = client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        responses_input: Any = [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe it."},
                    responses_image(data_url(OTHER)),
                ],
            }
        ]
        response = client.responses.create(
            model=MODEL, input=responses_input, max_output_tokens=MAX_TOKENS, temperature=0
        )
        message = claude.messages.create(
            model=MODEL, max_tokens=MAX_TOKENS, messages=_read_turn(SHOT), extra_body=GREEDY
        )
    finally:
        server.state.on_submit = None
    assert reply.choices[0].message.content == _expected_text(server, oracle, seen[0], SHOT)
    assert streamed == reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.prompt_tokens == len(seen[0])
    assert response.output_text == _expected_text(server, oracle, seen[2], OTHER)
    text = message.content[0].text  # type: ignore[union-attr]
    assert text == _expected_text(server, oracle, seen[3], SHOT)
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == len(seen[3])


def test_a_resent_screenshot_hits_the_cache_and_another_does_not(server: ServerThread) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    before = httpx.get(server.url + "/metrics").text
    seen = _capture(server)
    try:
        replies = [
            claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=_read_turn(shot))
            for shot in (noise_png(5), noise_png(5), noise_png(6))
        ]
    finally:
        server.state.on_submit = None
    start = min(i for i, t in enumerate(seen[0]) if t >= IMAGE_KEY_BASE)
    first, again, other = (r.usage.cache_read_input_tokens or 0 for r in replies)
    assert again >= start + IMAGE_TOKENS
    assert other <= start and first <= start
    after = httpx.get(server.url + "/metrics").text

    def grew(sample: str, **labels: str) -> float:
        return (metric(after, sample, **labels) or 0.0) - (metric(before, sample, **labels) or 0.0)

    assert grew("mlxserve_images_total", outcome="accepted", model_name=MODEL) == 3
    # The re-sent screenshot skipped the vision tower.
    assert grew("mlxserve_vision_seconds_count", model_name=MODEL) == 2
    assert grew("mlxserve_vision_seconds_sum", model_name=MODEL) > 0


def test_count_tokens_counts_image_tokens_and_a_typed_placeholder_is_a_400(
    server: ServerThread,
) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)

    def count(*blocks: Any) -> int:
        content = [*blocks, {"type": "text", "text": "What is it?"}]
        messages: Any = [{"role": "user", "content": content}]
        return claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    assert count(anthropic_image(SHOT)) >= count() + IMAGE_TOKENS
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    placeholder = server.state.engine.model.vision.image_token
    typed = {"type": "text", "text": f"see {placeholder}"}
    chat: Any = [{"role": "user", "content": [typed, openai_image(data_url(SHOT))]}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=chat, max_tokens=MAX_TOKENS)
    error = bad.value.body
    assert isinstance(error, dict) and "placeholder" in error["message"]
