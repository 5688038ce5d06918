"""Images through the engine on the tiny LLaVA checkpoint (`make-model --family llama --vision`).

Greedy tokens for an image prompt equal mlx-vlm's own generation on the same checkpoint
and image: alone, batched with another image and two text requests (one long, prefilled
in several chunks), and prefilled in chunks of at most 5 tokens, so chunk boundaries fall
inside the 16-position image span. Image
positions are keyed by the image's hash: the same image re-sent is a prefix-cache hit
(RAM, and the disk tier across a restart) that skips the vision tower; another image at
the same positions shares only the text before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import started_engine, tokens_of
from vision_helpers import Oracle, chat, noise_png, submit_prompts

from mlxserve.chat import PromptError, PromptIds
from mlxserve.cli import main as cli_main
from mlxserve.config import EngineConfig
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.tiny.vision import IMAGE_TOKENS
from mlxserve.models.vision import IMAGE_KEY_BASE

MAX_TOKENS = 6
SHOT = noise_png(1)
OTHER = noise_png(2)
LONG = "Count the words: " + " ".join(f"word{i}" for i in range(40))


@pytest.fixture
def model(vision_model: LoadedModel) -> LoadedModel:
    return vision_model


def _expected(oracle: Oracle, prompt: PromptIds, *images: bytes) -> list[int]:
    return oracle.tokens(prompt.text, list(images), MAX_TOKENS)


def _run(
    model: LoadedModel, config: EngineConfig, prompts: Sequence[PromptIds], one_by_one: bool
) -> tuple[list[tuple[list[int], Any]], dict[str, Any]]:
    """Each prompt's (tokens, last event), all at once or one after another; the stats."""

    async def main() -> tuple[list[tuple[list[int], Any]], dict[str, Any]]:
        engine = await started_engine(config, lambda: model)
        try:
            runs = await submit_prompts(engine, prompts, MAX_TOKENS, one_by_one)
            return [(tokens_of(events), events[-1]) for events in runs], engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_the_checkpoint_reads_images_and_make_model_refuses_other_families(
    model: LoadedModel, tmp_path: Path
) -> None:
    assert model.reads_images and model.vision is not None
    assert model.model_type == "llava" and model.chat_encoder == "template"
    # What the admission counts per image position while its prompt prefills: one row of
    # the 64-wide input embeddings.
    assert model.vision.feature_bytes_per_position() in (64 * 2, 64 * 4)
    code = cli_main(["make-model", str(tmp_path / "q"), "--family", "qwen3", "--vision"])
    assert code == 2 and not (tmp_path / "q").exists()


def test_image_positions_hold_ids_derived_from_the_image(model: LoadedModel) -> None:
    shot, again, other = (chat(model, "What is it?", data) for data in (SHOT, SHOT, OTHER))
    (image,) = shot.images
    assert image.length == IMAGE_TOKENS and shot.text.count(model.vision.image_token) == 1
    span = slice(image.start, image.end)
    assert all(t >= IMAGE_KEY_BASE for t in shot.token_ids[span])
    assert all(t < IMAGE_KEY_BASE for i, t in enumerate(shot.token_ids) if i not in range(16, 32))
    assert again.token_ids == shot.token_ids
    assert len(other.token_ids) == len(shot.token_ids)
    assert other.token_ids[: image.start] == shot.token_ids[: image.start]
    assert all(a != b for a, b in zip(other.token_ids[span], shot.token_ids[span], strict=True))
    with pytest.raises(PromptError, match="placeholder"):
        chat(model, f"typed {model.vision.image_token} by hand", SHOT)


def test_greedy_tokens_equal_mlx_vlm_alone_and_batched_with_text(
    model: LoadedModel, oracle: Oracle
) -> None:
    """A batch of 4 (two images, two texts, one of them long) under a 24-token chunk
    budget: the long prompt prefills in several chunks, and each row gets its tokens."""
    shot = chat(model, "What is in the picture?", SHOT)
    other = chat(model, "And this one?", OTHER)
    texts = [chat(model, "Say something."), chat(model, LONG)]
    want = [_expected(oracle, shot, SHOT), _expected(oracle, other, OTHER)]
    want += [_expected(oracle, t) for t in texts]
    (alone,), _ = _run(model, EngineConfig(prefix_cache=False), [shot], one_by_one=True)
    assert alone[0] == want[0]
    # usage: the image's positions are prompt tokens.
    assert alone[1].prompt_tokens == len(shot.token_ids)
    chunked = EngineConfig(prefix_cache=False, max_prefill_tokens=24)
    batch, stats = _run(model, chunked, [shot, texts[0], other, texts[1]], one_by_one=False)
    assert [tokens for tokens, _ in batch] == [want[0], want[2], want[1], want[3]]
    assert stats["vision"]["images"] == 2
    assert len(texts[1].token_ids) >= 3 * 24 and stats["steps"] >= len(texts[1].token_ids) // 24


def test_chunk_boundaries_inside_an_image_span_give_the_same_tokens(
    model: LoadedModel, oracle: Oracle
) -> None:
    """At most 5 tokens a step: the 16-position span is cut by at least three chunk
    boundaries, while a text request decodes beside it; the tower runs once."""
    shot = chat(model, "What is in the picture?", SHOT)
    text = chat(model, "Say something.")
    config = EngineConfig(prefix_cache=False, max_prefill_tokens=5)
    runs, stats = _run(model, config, [text, shot], one_by_one=False)
    assert runs[1][0] == _expected(oracle, shot, SHOT)
    assert runs[0][0] == _expected(oracle, text)
    assert stats["vision"]["images"] == 1
    assert stats["steps"] >= len(shot.token_ids) // 5


def test_the_same_image_resent_hits_and_another_image_does_not(
    model: LoadedModel, oracle: Oracle
) -> None:
    shot = chat(model, "What is in the picture?", SHOT)
    other = chat(model, "What is in the picture?", OTHER)
    runs, stats = _run(model, EngineConfig(), [shot, shot, other], one_by_one=True)
    (first, cold), (second, warm), (third, miss) = runs
    assert first == second == _expected(oracle, shot, SHOT)
    assert third == _expected(oracle, other, OTHER)
    image = shot.images[0]
    assert cold.cached_tokens == 0
    assert warm.cached_tokens >= image.end
    # Another image at the same positions shares only the text before it.
    assert miss.cached_tokens <= image.start
    # The re-sent image skipped the tower.
    assert stats["vision"]["images"] == 2


def test_the_disk_tier_keys_images_by_content_across_a_restart(
    model: LoadedModel, oracle: Oracle, tmp_path: Path
) -> None:
    shot = chat(model, "What is in the picture?", SHOT)
    other = chat(model, "What is in the picture?", OTHER)
    config = EngineConfig(prefix_cache_dir=str(tmp_path / "disk"), prefix_cache_bytes=1 << 30)
    _run(model, config, [shot], one_by_one=True)
    runs, stats = _run(model, config, [shot, other], one_by_one=True)
    (restored, warm), (fresh, miss) = runs
    assert restored == _expected(oracle, shot, SHOT)
    assert fresh == _expected(oracle, other, OTHER)
    assert warm.cached_tokens >= shot.images[0].end
    assert stats["prefix_cache_disk"]["hits"] >= 1
    assert miss.cached_tokens <= other.images[0].start
    assert stats["vision"]["images"] == 1
