"""Images through the engine on the tiny DeepSeek-V4 with a vision tower
(`make-model --family deepseek_v4 --vision`).

The image's placeholder sits where mlx-vlm's processor puts it (a content list's parts
joined with nothing between), and its positions hold the processor's sentinels, which
the language model reads: the engine feeds a prompt from its start to the end of its last
image in one prefill, even under a 5-token chunk budget, and uses a prefix-cache hit only
if it covers every image. Greedy tokens equal mlx-vlm's own generation until a decode step
closes a pooling window (where mlx-vlm's compressor drops its overlap window, as
`test_models.py` pins for text), and the engine's own alone, in a batch of 4 (two images,
two texts, one long) and chunked. Over HTTP (one server, with a disk tier): OpenAI chat
and Responses answer an image prompt with the engine's own tokens, streamed and not;
Claude Code's screenshot inside a `tool_result` is answered, and after a restart the next
turn re-sending it is a disk hit that covers it, while another image is not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from api_fixtures import ServerThread, serve_args
from engine_helpers import started_engine, tokens_of
from image_helpers import anthropic_image, data_url, openai_image, responses_image
from vision_helpers import Oracle, image_part, noise_png, submit_prompts

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
MODEL = "tiny-dsv4-vision"
LONG = "Count the words: " + " ".join(f"word{i}" for i in range(30))


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
        prompts = [
            render_prompt(engine.model, PromptRequest(m, chat_template_kwargs=NO_THINKING))
            for m in conversations
        ]
        try:
            runs = await submit_prompts(engine, prompts, MAX_TOKENS, one_by_one)
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


# Two image prompts, two text ones, the last long (several chunks under any small budget).
CONVERSATIONS = (
    _turns(SHOT),
    _turns(None),
    _turns(OTHER, next_turn=True),
    [{"role": "user", "content": LONG}],
)
IMAGES = (SHOT, None, OTHER, None)


@pytest.fixture(scope="module")
def alone(checkpoint: Path) -> tuple[list[PromptIds], list[list[int]]]:
    """Each of CONVERSATIONS rendered, and its single-request greedy tokens."""
    config = EngineConfig(prefix_cache=False)
    prompts, runs, _ = _run(checkpoint, config, CONVERSATIONS, one_by_one=True)
    return prompts, [tokens for tokens, _ in runs]


@pytest.mark.slow
def test_greedy_tokens_equal_mlx_vlm_alone_and_batched_in_small_chunks(
    alone: tuple[list[PromptIds], list[list[int]]], checkpoint: Path, oracle: Oracle
) -> None:
    """A batch of 4 under a 5-token chunk budget: the image prompts still prefill up to
    their image's end in one forward (mlx-vlm's model refuses sentinels after position 0
    otherwise), the long text prompt in many chunks, and each row gets the tokens it gets
    alone."""
    config = EngineConfig(prefix_cache=False, max_prefill_tokens=5)
    prompts, runs, stats = _run(checkpoint, config, CONVERSATIONS, one_by_one=False)
    assert [tokens for tokens, _ in runs] == alone[1]
    for prompt, (tokens, _), image in zip(prompts, runs, IMAGES, strict=True):
        _agrees_with_mlx_vlm(oracle, prompt, image, tokens)
    assert stats["vision"]["images"] == 2
    assert stats["steps"] >= len(prompts[3].token_ids) // 5 >= 10


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


class Serving:
    """The module's one server on the checkpoint, with a disk tier; `restart` stops it
    (its engine writes what only RAM holds to disk) and serves the same folder again."""

    def __init__(self, checkpoint: Path, disk: Path) -> None:
        self.argv = ["--served-model-name", MODEL, "--prefix-cache-dir", str(disk)]
        self.checkpoint = checkpoint
        self.server = self._start()

    def _start(self) -> ServerThread:
        # No loader: the server loads the checkpoint on its engine's thread.
        return ServerThread(serve_args(*self.argv, model=str(self.checkpoint)), None).start()

    def restart(self) -> None:
        self.server.stop()
        self.server = self._start()


@pytest.fixture(scope="module")
def serving(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    served = Serving(checkpoint, tmp_path_factory.mktemp("dsv4-vision-disk"))
    try:
        yield served
    finally:
        served.server.stop()


def _part(kind: str, text: str) -> dict[str, str]:
    return {"type": kind, "text": text}


def test_openai_chat_and_responses_answer_with_the_engines_own_tokens(
    serving: Serving, alone: tuple[list[PromptIds], list[list[int]]]
) -> None:
    """`image_url` and `input_image` parts render the prompts the engine ran alone (which
    agree with mlx-vlm, see above), and the answers, streamed and not, are its tokens."""
    server = serving.server
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    look, what = "Look:", "What is it?"
    shot = openai_image(data_url(SHOT))
    chat: Any = [{"role": "user", "content": [_part("text", look), shot, _part("text", what)]}]
    parts = [_part("input_text", look), responses_image(data_url(OTHER)), _part("input_text", what)]
    later: Any = [{"role": "user", "content": parts}, *CONVERSATIONS[2][1:]]
    chat_args: Any = {"model": MODEL, "messages": chat, "max_tokens": MAX_TOKENS}
    chat_args.update(temperature=0, extra_body={"chat_template_kwargs": NO_THINKING})
    responses_args: Any = {"model": MODEL, "input": later, "max_output_tokens": MAX_TOKENS}
    responses_args.update(temperature=0, reasoning={"effort": "none"})
    seen: list[list[int]] = []
    server.state.on_submit = lambda _rid, ids: seen.append(list(ids))
    try:
        reply = client.chat.completions.create(**chat_args)
        chunks = client.chat.completions.create(**chat_args, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        response = client.responses.create(**responses_args)
        events = client.responses.create(**responses_args, stream=True)
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    finally:
        server.state.on_submit = None
    prompts, tokens = alone
    assert seen == [prompts[0].token_ids] * 2 + [prompts[2].token_ids] * 2
    decode = server.state.engine.model.tokenizer.decode
    assert reply.choices[0].message.content == streamed == decode(tokens[0])
    assert reply.usage is not None and reply.usage.prompt_tokens == len(seen[0])
    assert response.output_text == deltas == decode(tokens[2])


def test_claude_codes_screenshot_is_answered_and_resent_after_a_restart_as_a_disk_hit(
    serving: Serving,
) -> None:
    """`Read` on a PNG answers with an image inside the tool_result: answered (streamed
    too). After a restart on the same disk tier, the next turn re-sending it hits past the
    image, and the same turn holding another image is a cold prefill (its hit would end
    before the image). Restarts the module's server: the last test to use it."""
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

    def client() -> anthropic.Anthropic:
        url = serving.server.url
        return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)

    def ask(messages: Any) -> Any:
        # Thinking off: the next turn's render extends this one's prompt.
        disabled: Any = {"type": "disabled"}
        return client().messages.create(
            model=MODEL, max_tokens=MAX_TOKENS, messages=messages, thinking=disabled
        )

    first = ask(turn(SHOT))
    with client().messages.stream(
        model=MODEL, max_tokens=MAX_TOKENS, messages=turn(OTHER)
    ) as stream:
        streamed = stream.get_final_message()
    serving.restart()
    resent, other = ask(next_turn(SHOT)), ask(next_turn(noise_png(7)))
    stats = serving.server.state.engine.stats()
    for message in (first, streamed, resent, other):
        assert message.stop_reason in ("max_tokens", "end_turn")
        assert message.usage.output_tokens > 0
    # The whole first turn, its image included, came from the disk tier.
    assert resent.usage.cache_read_input_tokens == first.usage.input_tokens
    assert stats["prefix_cache_disk"]["hits"] >= 1
    assert not other.usage.cache_read_input_tokens
    assert stats["vision"]["images"] == 1  # the re-sent screenshot skipped the tower


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
