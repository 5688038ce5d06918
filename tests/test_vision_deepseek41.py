"""Images through the engine on the tiny DeepSeek-V4.1 with a vision tower
(`make-model --family deepseek_v41 --vision`).

The language model is mlx-lm's V4.1 with our batching; an image's span (delimiters
included) is fed the block mlx-vlm's own merge writes and its MoE gates route by
`bias_vl` (`models/deepseek_v4/v41_image_route.py`). Attention is causal, so a chunk
may end inside a span. The wrapped router is mlx-vlm's gate on the same rows; the
features are mlx-vlm's merge of the whole prompt; greedy tokens equal mlx-vlm's own
generation. mlx-vlm's V4.1 text math is not mlx-lm's (it rounds every linear layer's
input through FP8, as the reference does, and weights the experts before their down
projection; mlx-lm skips the rounding as more precise): the same text prompt's logits
differ by up to about 1, so the prompt compared is one whose greedy steps keep clear of
that (and whose tokens change when the gates ignore `bias_vl`). Chunked (a boundary
inside the span), batched and cache-warm runs give the one forward's tokens exactly.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import openai
import pytest
from api_fixtures import ServerThread, serve_args
from image_helpers import data_url, openai_image
from PIL import Image
from vision_helpers import (
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
from mlxserve.models.deepseek_v4.v41_image_route import ImageRouter, image_feed
from mlxserve.models.deepseek_v4.v41_vision import DeepseekV41Tower
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel

MAX_TOKENS = 6
SHOT = noise_png(4)
OTHER = noise_png(2)
THIRD = noise_png(3)
# 9x7 patches: a span of 14 positions (3 rows of 3 features, each closed by a newline).
BIG_SHOT = noise_png(5, (120, 90))
QUESTION = "Colours?"
NO_THINKING = {"thinking": False}
MODEL = "tiny-dsv41-vision"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dsv41-vision") / "tiny"
    assert cli_main(["make-model", str(out), "--family", "deepseek_v41", "--vision"]) == 0
    return out


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> LoadedModel:
    return load(checkpoint)


@pytest.fixture(scope="module")
def mlx_vlm_model(checkpoint: Path) -> Any:
    from mlx_vlm.utils import load_model, load_processor

    return load_model(checkpoint), load_processor(checkpoint)


def _turns(image: bytes | None, next_turn: bool = False) -> list[Any]:
    return image_turns(image, QUESTION, next_turn)


def _text_image_text(image: bytes) -> list[Any]:
    before = {"type": "text", "text": "Read this first: " + " ".join(f"w{i}" for i in range(24))}
    content = [before, image_part(image), {"type": "text", "text": "What is it?"}]
    return [{"role": "user", "content": content}]


def _render(model: LoadedModel, conversation: list[Any]) -> PromptIds:
    return render_prompt(model, PromptRequest(conversation, chat_template_kwargs=NO_THINKING))


def _chunk_logits(model: LoadedModel, prompt: PromptIds, cuts: Sequence[int]) -> mx.array:
    """(L, V): the prompt fed in chunks [cuts[i], cuts[i + 1]) over one cache."""
    module, cache, out = model.model.module, model.make_cache(), []
    for start, end in zip(cuts, cuts[1:], strict=False):
        ids, embeddings = chunk_inputs(model, prompt, start, end)
        if embeddings is None:
            out.append(model.model(ids, cache)[0])
        else:
            feed = image_feed(module)
            assert feed is not None
            out.append(module.lm_head(feed.hidden(module, ids, cache, embeddings))[0])
    return mx.concatenate(out)


def _one_forward_tokens(model: LoadedModel, prompt: PromptIds) -> list[int]:
    """Our single-request greedy run: the whole prompt in one forward, then a token a step."""
    cache = model.make_cache()
    ids, embeddings = chunk_inputs(model, prompt, 0, len(prompt.token_ids))
    logits = model.model.last_logits(ids, cache, embeddings=embeddings)
    tokens = [int(mx.argmax(logits[0]))]
    while len(tokens) < MAX_TOKENS:
        logits = model.model.last_logits(mx.array([tokens[-1:]], dtype=mx.int32), cache)
        tokens.append(int(mx.argmax(logits[0])))
    return tokens


def _mlx_vlm_tokens(mlx_vlm_model: Any, prompt: PromptIds, images: list[bytes]) -> list[int]:
    """mlx-vlm's own greedy steps (`generate_step`: its `generate` minus the streaming
    detokenizer, which cannot spell the random model's special tokens) on its processor's
    reading of the prompt's text."""
    from mlx_vlm.generate.ar import generate_step

    vlm, processor = mlx_vlm_model
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    inputs = processor(text=[prompt.text], images=pictures)
    steps = generate_step(
        inputs["input_ids"],
        vlm,
        inputs["pixel_values"],
        None,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    return [int(token) for token, _ in steps]


def _run(
    checkpoint: Path, config: EngineConfig, conversations: Sequence[list[Any]], one_by_one: bool
) -> Runs:
    return run_conversations(checkpoint, config, conversations, one_by_one, MAX_TOKENS, NO_THINKING)


def test_the_checkpoint_serves_mlx_lms_text_model_and_mlx_vlms_tower(
    checkpoint: Path, model: LoadedModel
) -> None:
    """Loaded as mlx-lm's V4.1 (text logits exactly mlx-lm's own load of the same files)
    beside mlx-vlm's tower, which is causal: no image is read whole."""
    from mlx_lm.utils import load_model as mlx_lm_load

    assert model.reads_images and isinstance(model.vision, DeepseekV41Tower)
    assert not model.vision.whole_images
    plain, _ = mlx_lm_load(checkpoint)
    ids = mx.array([_render(model, _turns(None)).token_ids], dtype=mx.int32)
    assert mx.array_equal(model.model(ids, model.make_cache()), plain(ids))


def test_the_router_is_mlx_vlms_gate_on_the_same_rows(
    model: LoadedModel, mlx_vlm_model: Any
) -> None:
    """Our wrapped router and mlx-vlm's V4.1 gate pick the same experts with the same
    weights for text and image rows; without an image mask it is mlx-lm's router, and
    `bias_vl` moves some rows' picks (so the check can fail)."""
    vlm, _ = mlx_vlm_model
    x = mx.random.normal((24, vlm.config.hidden_size), key=mx.random.key(3))
    image_rows = mx.arange(24) % 3 == 0
    moved = 0
    for n, layer in enumerate(model.model.module.model.layers):
        assert isinstance(layer.mlp.gate, ImageRouter)
        picks, weights = _by_expert(*layer.mlp.gate.route(x, image_rows))
        theirs = _by_expert(*vlm.language_model.layers[n].ffn.gate(x, image_rows))
        assert mx.array_equal(picks, theirs[0])
        assert mx.allclose(weights, theirs[1], atol=1e-6).item()
        text = _by_expert(*layer.mlp.gate.inner(x))
        assert mx.array_equal(_by_expert(*layer.mlp.gate(x))[0], text[0])  # no feed: text
        # The restated math is mlx-lm's router's on text rows, bit for bit.
        restated = _by_expert(*layer.mlp.gate.route(x, mx.zeros((24,), dtype=mx.bool_)))
        assert all(mx.array_equal(a, b) for a, b in zip(restated, text, strict=True))
        moved += int(mx.sum(mx.any(picks != text[0], axis=-1)).item())
    assert moved > 0


def _by_expert(picks: mx.array, weights: mx.array) -> tuple[mx.array, mx.array]:
    order = mx.argsort(picks, axis=-1)
    return mx.take_along_axis(picks, order, -1), mx.take_along_axis(weights, order, -1)


def test_features_are_mlx_vlms_merge_and_tokens_its_generation(
    checkpoint: Path, model: LoadedModel, mlx_vlm_model: Any
) -> None:
    """The image's rows are mlx-vlm's merge of the whole prompt, bit for bit; the engine's
    greedy tokens are the one forward's and mlx-vlm's own generation's (see the module
    docstring for why this prompt)."""
    vlm, processor = mlx_vlm_model
    prompt = _render(model, _turns(SHOT))
    (image,) = prompt.images
    inputs = processor(text=[prompt.text], images=[Image.open(io.BytesIO(SHOT)).convert("RGB")])
    merged = vlm.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"]).inputs_embeds
    assert inputs["input_ids"].shape[1] == len(prompt.token_ids)
    _, embeddings = chunk_inputs(model, prompt, 0, len(prompt.token_ids))
    assert mx.array_equal(
        embeddings[0, image.start : image.end], merged[0, image.start : image.end]
    )
    _, runs, _ = _run(checkpoint, EngineConfig(prefix_cache=False), [_turns(SHOT)], True)
    ((tokens, _),) = runs
    assert (
        tokens
        == _one_forward_tokens(model, prompt)
        == _mlx_vlm_tokens(mlx_vlm_model, prompt, [SHOT])
    )


def test_chunks_ending_inside_an_image_compute_the_one_forward(model: LoadedModel) -> None:
    """Attention is causal: chunks cut anywhere in the span (or around it) give each
    position the one forward's logits (float noise apart) and argmax."""
    prompt = _render(model, _text_image_text(BIG_SHOT))
    (image,) = prompt.images
    n = len(prompt.token_ids)
    whole = _chunk_logits(model, prompt, [0, n])
    for cuts in (
        [0, image.start + 3, image.start + 9, n],
        [0, image.start - 1, image.start + 1, image.end - 1, n],
    ):
        chunked = _chunk_logits(model, prompt, cuts)
        assert mx.allclose(chunked, whole, atol=1e-3).item(), cuts
        assert mx.array_equal(mx.argmax(chunked, -1), mx.argmax(whole, -1)), cuts


def test_a_batch_in_chunks_that_cut_the_image_gives_each_row_its_own_tokens(
    checkpoint: Path, model: LoadedModel
) -> None:
    """An image prompt, a text prompt and one with a 14-position image after long text,
    at once under a 3-token budget (every span is cut by a chunk's end): each row's
    tokens are its single forward's."""
    conversations = [_turns(SHOT), _turns(None), _text_image_text(BIG_SHOT)]
    config = EngineConfig(prefix_cache=False, max_prefill_tokens=3)
    prompts, runs, stats = _run(checkpoint, config, conversations, one_by_one=False)
    assert all(image.length > 3 for p in prompts for image in p.images)
    for prompt, (tokens, _) in zip(prompts, runs, strict=True):
        assert tokens == _one_forward_tokens(model, prompt)
    assert stats["vision"]["images"] == 2
    assert stats["steps"] >= len(prompts[2].token_ids) // 3


def test_the_same_image_resent_hits_past_it_and_another_shares_only_the_text(
    checkpoint: Path, model: LoadedModel
) -> None:
    """A prompt holding another image after the same text branches there, so a third
    image's prompt hits only the text before its image; the next turn re-sending an
    image hits past it (the tower skipped). Each answers with its one-forward tokens."""
    conversations = [
        _text_image_text(SHOT),
        _text_image_text(OTHER),
        _text_image_text(THIRD),
        _turns(SHOT),
        _turns(SHOT, next_turn=True),
    ]
    prompts, runs, stats = _run(checkpoint, EngineConfig(), conversations, one_by_one=True)
    assert_hits_around_images(prompts, [hit for _, hit in runs], stats["vision"])
    for prompt, (tokens, _) in zip(prompts, runs, strict=True):
        assert tokens == _one_forward_tokens(model, prompt)


def test_openai_chat_answers_an_image_with_the_one_forward_tokens(
    checkpoint: Path, model: LoadedModel
) -> None:
    server = ServerThread(serve_args("--served-model-name", MODEL, model=str(checkpoint)), None)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        content: Any = [
            {"type": "text", "text": "Look:"},
            openai_image(data_url(SHOT)),
            {"type": "text", "text": QUESTION},
        ]
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
    finally:
        server.stop()
    tokens = _one_forward_tokens(model, _render(model, _turns(SHOT)))
    assert reply.choices[0].message.content == model.tokenizer.decode(tokens)
