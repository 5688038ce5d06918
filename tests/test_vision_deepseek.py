"""Images through the engine on the tiny DeepSeek-V4 with a vision tower
(`make-model --family deepseek_v4 --vision`).

The image's placeholder sits where mlx-vlm's processor puts it (a content list's parts
joined with nothing between), and its positions hold the processor's sentinels, which
the language model reads: the engine feeds a prompt from its start to the end of its last
image in one prefill, even under a 5-token chunk budget, and uses a prefix-cache hit only
if it covers every image. Greedy tokens equal mlx-vlm's own generation until a decode step
closes a pooling window (where mlx-vlm's compressor drops its overlap window, as
`test_models.py` pins for text), and the engine's own alone, batched and chunked. Over
HTTP, Claude Code's screenshot inside a `tool_result` is answered, and the next turn
re-sending it is a hit that covers it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anthropic
import pytest
from api_fixtures import ServerThread, serve_args
from engine_helpers import collect, started_engine, tokens_of
from image_helpers import anthropic_image
from vision_helpers import Oracle, image_part, noise_png

from mlxserve.chat import PromptIds, PromptRequest, render_prompt
from mlxserve.cli import main as cli_main
from mlxserve.config import EngineConfig
from mlxserve.engine.request import SamplingParams
from mlxserve.models.load import load
from mlxserve.models.vision import IMAGE_KEY_BASE

MAX_TOKENS = 6
SHOT = noise_png(1)
OTHER = noise_png(2)
NO_THINKING = {"thinking": False}  # a next turn's render extends the last one's prompt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dsv4-vision") / "tiny"
    assert cli_main(["make-model", str(out), "--family", "deepseek_v4", "--vision"]) == 0
    return out


@pytest.fixture(scope="module")
def oracle(checkpoint: Path) -> Oracle:
    return Oracle(checkpoint)


def _turns(image: bytes | None, next_turn: bool = False) -> list[dict[str, Any]]:
    content: list[Any] = [{"type": "text", "text": "Look:"}]
    if image is not None:
        content.append(image_part(image))
    content.append({"type": "text", "text": "What is it?"})
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if next_turn:
        messages += [
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": "Which colours?"},
        ]
    return messages


def _run(
    checkpoint: Path,
    config: EngineConfig,
    conversations: Sequence[list[dict[str, Any]]],
    one_by_one: bool,
) -> tuple[list[PromptIds], list[tuple[list[int], int]], dict[str, Any]]:
    """Each conversation rendered by the engine's model, its (tokens, cached tokens); the
    engine's stats. The model loads on the engine's thread, as a server loads it."""

    async def main() -> tuple[list[PromptIds], list[tuple[list[int], int]], dict[str, Any]]:
        engine = await started_engine(config, lambda: load(checkpoint))
        params = SamplingParams(max_tokens=MAX_TOKENS)
        prompts = [
            render_prompt(engine.model, PromptRequest(m, chat_template_kwargs=NO_THINKING))
            for m in conversations
        ]

        def submit(p: PromptIds) -> Any:
            return collect(engine.submit(p.token_ids, params, images=p.images))

        try:
            if one_by_one:
                runs = [await submit(p) for p in prompts]
            else:
                runs = list(await asyncio.gather(*(submit(p) for p in prompts)))
            results = [(tokens_of(events), events[-1].cached_tokens) for events in runs]
            return prompts, results, engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def _agrees_with_mlx_vlm(
    oracle: Oracle, prompt: PromptIds, image: bytes | None, tokens: list[int]
) -> None:
    """mlx-vlm's own generate gives the same tokens up to the decode step that closes a
    pooling window (from there on its compressor drops the overlap window, see
    `test_models.py`): 1 to 4 tokens."""
    agreed = 4 - len(prompt.token_ids) % 4
    images = [image] if image is not None else []
    assert tokens[:agreed] == oracle.tokens(prompt.text, images, agreed)


def test_the_placeholder_sits_where_mlx_vlms_processor_puts_it(checkpoint: Path) -> None:
    from mlx_vlm.models.deepseek_v4.processing_deepseek_v4 import DeepseekV4Processor

    model = load(checkpoint)
    assert model.reads_images and model.vision is not None and model.vision.whole_prefill
    prompt = render_prompt(model, PromptRequest(_turns(SHOT), chat_template_kwargs=NO_THINKING))
    theirs = DeepseekV4Processor._content_to_text(
        [
            {"type": "text", "text": "Look:"},
            {"type": "image"},
            {"type": "text", "text": "What is it?"},
        ]
    )
    assert f"<｜User｜>{theirs}<｜Assistant｜>" in prompt.text
    (image,) = prompt.images
    # The block starts on a multiple of 4 after its pads; keyed ids hold its positions.
    assert all(t >= IMAGE_KEY_BASE for t in prompt.token_ids[image.start : image.end])
    assert image.model_ids[-1] == model.vocab_size + 4  # the block's end sentinel


@pytest.mark.slow
def test_greedy_tokens_equal_mlx_vlm_alone_and_batched_in_small_chunks(
    checkpoint: Path, oracle: Oracle
) -> None:
    """Under a 5-token chunk budget, batched with a text request, the image prompts still
    prefill up to their image's end in one forward (mlx-vlm's model refuses sentinels
    after position 0 otherwise) and give the tokens each gives alone."""
    conversations = [_turns(SHOT), _turns(None), _turns(OTHER, next_turn=True)]
    alone = _run(checkpoint, EngineConfig(prefix_cache=False), conversations, one_by_one=True)
    config = EngineConfig(prefix_cache=False, max_prefill_tokens=5)
    prompts, runs, stats = _run(checkpoint, config, conversations, one_by_one=False)
    assert [tokens for tokens, _ in runs] == [tokens for tokens, _ in alone[1]]
    for prompt, (tokens, _), image in zip(prompts, runs, (SHOT, None, OTHER), strict=True):
        _agrees_with_mlx_vlm(oracle, prompt, image, tokens)
    assert stats["vision"]["images"] == 2


def test_a_prefix_hit_is_used_only_if_it_covers_every_image(
    checkpoint: Path, oracle: Oracle
) -> None:
    """The next turn re-sending the screenshot hits (the tower skipped); the same turn with
    another image shares only the text before it, which is refused: a cold prefill."""
    conversations = [_turns(SHOT), _turns(SHOT, next_turn=True), _turns(OTHER, next_turn=True)]
    prompts, runs, stats = _run(checkpoint, EngineConfig(), conversations, one_by_one=True)
    (_, cold), (resent, hit), (other, miss) = runs
    assert cold == 0 and hit >= prompts[1].images[0].end and miss == 0
    _agrees_with_mlx_vlm(oracle, prompts[1], SHOT, resent)
    _agrees_with_mlx_vlm(oracle, prompts[2], OTHER, other)
    assert stats["vision"]["images"] == 2


def test_claude_codes_screenshot_over_http_is_answered_and_resent_as_a_hit(
    checkpoint: Path,
) -> None:
    """`Read` on a PNG answers with an image inside the tool_result: answered (streamed
    too); the next turn re-sending it hits past the image, and the same turn holding
    another image is a cold prefill (its hit would end before the image)."""
    args = serve_args("--served-model-name", "tiny-dsv4-vision", model=str(checkpoint))
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}

    def turn(shot: bytes) -> list[dict[str, Any]]:
        result = {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": [anthropic_image(shot)],
        }
        return [
            {"role": "user", "content": "Look at a.png"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]

    def next_turn(shot: bytes) -> list[dict[str, Any]]:
        reply = {"role": "assistant", "content": "It is noise."}
        return [*turn(shot), reply, {"role": "user", "content": "Which colours?"}]

    with ServerThread(args, None) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)

        def ask(messages: Any) -> Any:
            return claude.messages.create(
                model="tiny-dsv4-vision",
                max_tokens=MAX_TOKENS,
                messages=messages,
                thinking={"type": "disabled"},  # the next turn's render extends this one's
            )

        first = ask(turn(SHOT))
        with claude.messages.stream(
            model="tiny-dsv4-vision", max_tokens=MAX_TOKENS, messages=turn(OTHER)
        ) as stream:
            streamed = stream.get_final_message()
        resent, other = ask(next_turn(SHOT)), ask(next_turn(noise_png(7)))
        stats = server.state.engine.stats()
    for message in (first, streamed, resent, other):
        assert message.stop_reason in ("max_tokens", "end_turn")
        assert message.usage.output_tokens > 0
    # The whole first turn, its image included, came from the prefix cache.
    assert resent.usage.cache_read_input_tokens == first.usage.input_tokens
    assert not other.usage.cache_read_input_tokens
    assert stats["vision"]["images"] == 3  # the re-sent screenshot skipped the tower


def test_the_first_chunk_reaches_the_last_image_whatever_the_budget() -> None:
    """The scheduler alone: a 5-token budget, a prompt whose last image ends at 17."""
    from mlxserve.engine.plan import RequestOutput, StepResult
    from mlxserve.engine.request import Request
    from mlxserve.engine.scheduler import Scheduler

    scheduler = Scheduler(EngineConfig(prefix_cache=False, max_prefill_tokens=5), frozenset())
    request = Request("shot", list(range(1, 31)), SamplingParams(max_tokens=2), 0.0)
    request.whole_until = 17
    scheduler.add(request)
    (first,) = scheduler.schedule().prefills
    assert (first.start, first.end) == (0, 17)
    scheduler.update(StepResult(outputs=[RequestOutput("shot", computed=first.end)]))
    (second,) = scheduler.schedule().prefills
    assert second.start == 17 and second.num_tokens <= 5
