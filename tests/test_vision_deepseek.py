"""Images through the engine on the tiny DeepSeek-V4 with a vision tower
(`make-model --family deepseek_v4 --vision`).

The image's placeholder sits where mlx-vlm's processor puts it (a content list's parts
joined with nothing between), and its positions hold the processor's sentinels, which
the language model reads: a position inside an image block sees the whole block, so no
prefill chunk ends inside one, and a chunk holding a block may start anywhere over the
cache (`models/deepseek_v4/image_chunk.py` builds its mask; mlx-vlm's model takes
sentinels only from position 0). Our forward from position 0 is mlx-vlm's, bit for bit;
a prompt with text before and after a block longer than the sliding window, fed in
chunks (one starting before the block, the block alone, one after it), gives the logits
and greedy tokens of one forward; a chunk that would cut a block is refused. Greedy
tokens equal mlx-vlm's own generation until a decode step closes a pooling window (where
mlx-vlm's compressor drops its overlap window, as `test_models.py` pins for text), and
the engine's own alone, in a batch of 5 (three images, two texts, one long) and chunked. A
prefix-cache hit may end before an image (a prompt sharing only the text before it) or
cover it (the same image re-sent), with the cold prompt's tokens. Over HTTP (one server,
with a disk tier): OpenAI chat and Responses answer an image prompt with the engine's own
tokens, streamed and not; Claude Code's screenshot inside a `tool_result` is answered,
and after a restart the next turn re-sending it is a disk hit that covers it, while
another image is not.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import mlx.core as mx
import openai
import pytest
from api_fixtures import ServerThread, serve_args
from image_helpers import anthropic_image, data_url, openai_image, responses_image
from vision_helpers import (
    Oracle,
    Runs,
    assert_hits_around_images,
    chunk_inputs,
    image_part,
    image_turns,
    noise_png,
    run_conversations,
)

from mlxserve.chat import PromptIds, PromptRequest, render_prompt
from mlxserve.cli import main as cli_main
from mlxserve.config import EngineConfig
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.models.deepseek_v4.image_chunk import chunk_hidden, image_chunk_mask
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


def _run(
    checkpoint: Path, config: EngineConfig, conversations: Sequence[list[Any]], one_by_one: bool
) -> Runs:
    return run_conversations(checkpoint, config, conversations, one_by_one, MAX_TOKENS, NO_THINKING)


def _agrees_with_mlx_vlm(
    oracle: Oracle, prompt: PromptIds, image: bytes | None, tokens: list[int]
) -> None:
    """mlx-vlm's own generate gives the same tokens up to the decode step that closes a
    pooling window (from there on its compressor drops the overlap window, see
    `test_models.py`): 1 to 4 tokens."""
    agreed = 4 - len(prompt.token_ids) % 4
    images = [image] if image is not None else []
    assert tokens[:agreed] == oracle.tokens(prompt.text, images, agreed)


def _part(kind: str, text: str) -> dict[str, str]:
    return {"type": kind, "text": text}


# Text before and after a block longer than the sliding window (16): positions inside it
# see back to its start, past their window.
BEFORE = "Read this first, then look: " + " ".join(f"word{i}" for i in range(20))
BIG_SHOT = noise_png(3, (120, 90))
THIRD = noise_png(4)


def _text_image_text(image: bytes) -> list[dict[str, Any]]:
    content = [_part("text", BEFORE), image_part(image), _part("text", "What is it? In words.")]
    return [{"role": "user", "content": content}]


class OneForward:
    """Our own single-request greedy run, the oracle where mlx-vlm's generate differs: the
    whole prompt in one forward from position 0 (mlx-vlm's own forward), then one token a
    forward. `logits` feeds a prompt in given chunks instead, as the engine does."""

    def __init__(self, checkpoint: Path) -> None:
        self.model = load(checkpoint)
        self.module = self.model.model.module  # mlx-vlm's LanguageModel

    def inputs(self, prompt: PromptIds, start: int, end: int) -> tuple[mx.array, Any]:
        return chunk_inputs(self.model, prompt, start, end)

    def logits(self, prompt: PromptIds, cuts: Sequence[int]) -> mx.array:
        """(L, V): the prompt fed in chunks [cuts[i], cuts[i + 1]), those with images
        through `chunk_hidden`, the others as the engine feeds text."""
        cache = self.model.make_cache()
        out = []
        for start, end in itertools.pairwise(cuts):
            ids, embeddings = self.inputs(prompt, start, end)
            if embeddings is None:
                out.append(self.model.model(ids, cache)[0])
            else:
                hidden = chunk_hidden(self.module.model, ids, cache, embeddings)
                out.append(self.module.lm_head(hidden)[0])
        return mx.concatenate(out)

    def whole_logits(self, prompt: PromptIds, cache: list[Any]) -> mx.array:
        """(L, V): mlx-vlm's own forward over the whole prompt from position 0."""
        ids, embeddings = self.inputs(prompt, 0, len(prompt.token_ids))
        return self.module(ids, cache=cache, inputs_embeds=embeddings).logits[0]

    def tokens(self, prompt: PromptIds, max_tokens: int = MAX_TOKENS) -> list[int]:
        cache = self.model.make_cache()
        tokens = [int(mx.argmax(self.whole_logits(prompt, cache)[-1]))]
        while len(tokens) < max_tokens and tokens[-1] not in self.model.eos_token_ids:
            logits = self.model.model(mx.array([tokens[-1:]], dtype=mx.int32), cache)
            tokens.append(int(mx.argmax(logits[0, -1])))
        return tokens


@pytest.fixture(scope="module")
def one_forward(checkpoint: Path) -> OneForward:
    return OneForward(checkpoint)


def _render(one_forward: OneForward, conversation: list[dict[str, Any]]) -> PromptIds:
    request = PromptRequest(conversation, chat_template_kwargs=NO_THINKING)
    return render_prompt(one_forward.model, request)


def test_a_chunk_holding_an_image_computes_what_one_forward_does_at_any_offset(
    one_forward: OneForward,
) -> None:
    """Our forward from position 0 is mlx-vlm's; fed in chunks that start before the
    block (mid-prompt), hold it alone or with text, or follow it, each position's logits
    are the one forward's (float noise apart) and so is its argmax. The image mask
    matters: without it the logits are far off (so the check can fail)."""
    prompt = _render(one_forward, _text_image_text(BIG_SHOT))
    (image,) = prompt.images
    n = len(prompt.token_ids)
    assert image.length > 16 < image.start  # longer than the window, which it starts past
    whole = one_forward.whole_logits(prompt, one_forward.model.make_cache())
    assert mx.array_equal(one_forward.logits(prompt, [0, n]), whole)
    for cuts in (
        [0, 5, image.start, image.end, n],
        [0, 3, image.start, image.end, image.end + 3, n],
        [0, image.start - 1, image.end + 2, n],
    ):
        chunked = one_forward.logits(prompt, cuts)
        assert mx.allclose(chunked, whole, atol=1e-3).item(), cuts
        assert mx.array_equal(mx.argmax(chunked, -1), mx.argmax(whole, -1))
    with pytest.raises(ValueError, match="cut"):
        one_forward.logits(prompt, [0, image.start + 3, n])


def test_the_image_mask_is_the_one_forwards_rows_over_the_cached_window(
    one_forward: OneForward,
) -> None:
    """`image_chunk_mask` (mlx-vlm's mask functions, wrapped) for a chunk at offset o over
    the sliding-window cache is mlx-vlm's whole-prompt mask, its rows o.. and the key
    columns the cache holds (the window before o, then the chunk)."""
    from mlx_vlm.models.deepseek_v4.language import create_image_attention_mask

    args = one_forward.module.args
    prompt = _render(one_forward, _text_image_text(BIG_SHOT))
    (image,) = prompt.images
    n, window = len(prompt.token_ids), args.sliding_window
    ids, _ = one_forward.inputs(prompt, 0, n)
    reference = create_image_attention_mask(ids, args.vocab_size, window, args.vision_max_n_token)[
        0, 0
    ]
    for start in (image.start - 2, image.start):
        cache = one_forward.model.make_cache()
        one_forward.model.model(ids[:, :start], cache)
        mask = image_chunk_mask(one_forward.module.model, ids[:, start:], cache)
        first_key = start - min(window - 1, start)
        assert mx.array_equal(mask[0, 0], reference[start:, first_key:]), start


def test_an_image_prompt_in_small_chunks_answers_with_the_one_forward_tokens(
    checkpoint: Path, one_forward: OneForward, oracle: Oracle
) -> None:
    """Text, a block longer than the window, text, under a 5-token budget: fed in many
    chunks (the block alone, over the text before it), it answers with the one forward's
    greedy tokens, which are mlx-vlm's own up to the pooling window."""
    config = EngineConfig(prefix_cache=False, max_prefill_tokens=5)
    conversation = _text_image_text(BIG_SHOT)
    prompts, runs, stats = _run(checkpoint, config, [conversation], one_by_one=True)
    ((tokens, _),) = runs
    assert tokens == one_forward.tokens(prompts[0])
    _agrees_with_mlx_vlm(oracle, prompts[0], BIG_SHOT, tokens)
    (image,) = prompts[0].images
    assert stats["steps"] >= (len(prompts[0].token_ids) - image.length) // 5 + 1


def test_the_placeholder_sits_where_mlx_vlms_processor_puts_it(checkpoint: Path) -> None:
    from mlx_vlm.models.deepseek_v4.processing_deepseek_v4 import DeepseekV4Processor

    model = load(checkpoint)
    assert model.reads_images and model.vision is not None and model.vision.whole_images
    prompt = render_prompt(
        model, PromptRequest(image_turns(SHOT), chat_template_kwargs=NO_THINKING)
    )
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


# Three image prompts (the last with a block longer than the window) and two text ones, the
# second long (several chunks under any small budget).
CONVERSATIONS = (
    image_turns(SHOT),
    image_turns(None),
    image_turns(OTHER, next_turn=True),
    [{"role": "user", "content": LONG}],
    _text_image_text(BIG_SHOT),
)
IMAGES = (SHOT, None, OTHER, None, BIG_SHOT)


@pytest.fixture(scope="module")
def alone(checkpoint: Path) -> tuple[list[PromptIds], list[list[int]]]:
    """Each of CONVERSATIONS rendered, and its single-request greedy tokens."""
    config = EngineConfig(prefix_cache=False)
    prompts, runs, _ = _run(checkpoint, config, CONVERSATIONS, one_by_one=True)
    return prompts, [tokens for tokens, _ in runs]


@pytest.mark.slow
def test_greedy_tokens_equal_mlx_vlm_alone_and_batched_in_small_chunks(
    alone: tuple[list[PromptIds], list[list[int]]],
    checkpoint: Path,
    oracle: Oracle,
    one_forward: OneForward,
) -> None:
    """A batch of 5 under a 5-token chunk budget: the image prompts prefill in chunks (the
    text before the image, then the image block whole over that cache, then the rest),
    the long text prompt in many chunks, and each row gets the tokens it gets alone, which
    are the one forward's."""
    config = EngineConfig(prefix_cache=False, max_prefill_tokens=5)
    prompts, runs, stats = _run(checkpoint, config, CONVERSATIONS, one_by_one=False)
    assert [tokens for tokens, _ in runs] == alone[1]
    for prompt, (tokens, _), image in zip(prompts, runs, IMAGES, strict=True):
        _agrees_with_mlx_vlm(oracle, prompt, image, tokens)
        assert tokens == one_forward.tokens(prompt)
    assert stats["vision"]["images"] == 3
    assert stats["steps"] >= len(prompts[3].token_ids) // 5 >= 10


def test_a_prefix_hit_ends_before_an_image_or_covers_it(
    checkpoint: Path, one_forward: OneForward
) -> None:
    """A prompt holding another image after the same text branches there (its snapshot
    ends before its image), so a third image's prompt hits that snapshot and feeds its
    image over it; the next turn re-sending an image hits past it (the tower skipped).
    Each answers with its one-forward tokens."""
    conversations = [
        _text_image_text(SHOT),
        _text_image_text(OTHER),
        _text_image_text(THIRD),
        image_turns(SHOT),
        image_turns(SHOT, next_turn=True),
    ]
    prompts, runs, stats = _run(checkpoint, EngineConfig(), conversations, one_by_one=True)
    assert_hits_around_images(prompts, [hit for _, hit in runs], stats["vision"])
    for prompt, (tokens, _) in zip(prompts, runs, strict=True):
        assert tokens == one_forward.tokens(prompt)


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


def test_no_chunk_ends_inside_an_image_whatever_the_budget() -> None:
    """The scheduler alone, a 5-token budget: a block longer than the budget is a chunk of
    its own, whole; a chunk that would end inside a shorter one ends before it; the other
    chunks keep the budget."""
    from mlxserve.engine.plan import RequestOutput, StepResult
    from mlxserve.engine.scheduler import Scheduler

    scheduler = Scheduler(EngineConfig(prefix_cache=False, max_prefill_tokens=5), frozenset())
    request = Request("shot", list(range(1, 41)), SamplingParams(max_tokens=2), 0.0)
    request.whole_spans = ((7, 19), (28, 31))
    scheduler.add(request)
    chunks = []
    while request.num_computed < request.num_prompt:
        (chunk,) = scheduler.schedule().prefills
        chunks.append((chunk.start, chunk.end))
        scheduler.update(StepResult(outputs=[RequestOutput("shot", computed=chunk.end)]))
    assert chunks == [(0, 5), (5, 7), (7, 19), (19, 24), (24, 28), (28, 33), (33, 38), (38, 40)]
