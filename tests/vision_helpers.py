"""The tiny LLaVA checkpoint of the vision tests, its images, and mlx-vlm's own greedy run."""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from engine_helpers import collect, started_engine, tokens_of
from PIL import Image

from mlxserve.chat import PromptIds, PromptRequest, render_prompt
from mlxserve.chat.images import ImagePart
from mlxserve.cli import main as cli_main
from mlxserve.config import EngineConfig
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.engine.vision_inputs import VisionInputs
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel


def make_checkpoint(out: Path) -> Path:
    """The checkpoint, written by `mlxserve make-model OUT --family llama --vision`."""
    assert cli_main(["make-model", str(out), "--family", "llama", "--vision"]) == 0
    return out


def noise_png(seed: int, size: tuple[int, int] = (60, 40)) -> bytes:
    """A PNG of seeded noise (different seeds: different pixels, and features)."""
    width, height = size
    pixels = bytes((seed * 131 + i * 7919 + (i * i) % 253) % 256 for i in range(width * height * 3))
    buf = io.BytesIO()
    Image.frombytes("RGB", size, pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_part(data: bytes) -> ImagePart:
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return ImagePart(data, "image/png", width, height, hashlib.sha256(data).hexdigest())


def chat(model: LoadedModel, text: str, *images: bytes) -> Any:
    """A one-turn user message with `images` before `text`, rendered (PromptIds)."""
    content: list[Any] = [image_part(data) for data in images]
    content.append({"type": "text", "text": text})
    return render_prompt(model, PromptRequest([{"role": "user", "content": content}]))


class Oracle:
    """mlx-vlm's own single-request greedy generation on the checkpoint: its model, its
    processor, its generate (the prompt text is the same rendered chat)."""

    def __init__(self, path: Path) -> None:
        from mlx_vlm.utils import load_model, load_processor

        self.model = load_model(path)
        self.processor = load_processor(path)

    def _inputs(self, text: str, images: list[bytes]) -> tuple[Any, dict[str, Any]]:
        """The processor's output, and the family's own image metadata in it (DeepSeek-V4:
        grids, offsets, layout types)."""
        pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        # mlx-vlm's processor, called as its `prepare_inputs` would but without the
        # `padding` argument transformers 5's image processors refuse for LLaVA.
        inputs = self.processor(text=[text], images=pictures or None)
        plain = ("input_ids", "attention_mask", "pixel_values")
        return inputs, {key: value for key, value in inputs.items() if key not in plain}

    def tokens(self, text: str, images: list[bytes], max_tokens: int) -> list[int]:
        from mlx_vlm import generate

        inputs, metadata = self._inputs(text, images)
        result = generate(
            self.model,
            self.processor,
            text,
            input_ids=inputs["input_ids"],
            pixel_values=inputs.get("pixel_values"),
            max_tokens=max_tokens,
            temperature=0.0,
            verbose=False,
            **metadata,
        )
        return [int(t) for t in result.token_ids]


async def submit_prompts(
    engine: Any, prompts: Sequence[PromptIds], max_tokens: int, one_by_one: bool
) -> list[list[Any]]:
    """Each prompt's events from `engine` (greedy, with its images), submitted one after
    another or all at once."""
    params = SamplingParams(max_tokens=max_tokens)

    def submit(p: PromptIds) -> Any:
        return collect(engine.submit(p.token_ids, params, images=p.images))

    if one_by_one:
        return [await submit(p) for p in prompts]
    return list(await asyncio.gather(*(submit(p) for p in prompts)))


def image_turns(
    image: bytes | None, question: str = "What is it?", next_turn: bool = False
) -> list[dict[str, Any]]:
    """A user turn "Look:" + the image + `question`; with `next_turn`, the assistant's
    answer and a second question after it (an agent's next request re-sends the image)."""
    content: list[Any] = [{"type": "text", "text": "Look:"}]
    if image is not None:
        content.append(image_part(image))
    content.append({"type": "text", "text": question})
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if next_turn:
        messages += [
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": "Which colours?"},
        ]
    return messages


def assert_hits_around_images(
    prompts: Sequence[PromptIds], hits: Sequence[int], vision: dict[str, Any]
) -> None:
    """The prefix-cache reads of five prompts run one by one: text + image A + text,
    the same text + image B (branches before its image), the same text + image C (hits
    only that text), a first turn with image A, and its next turn re-sending A (hits
    past A, whose tower then does not run: 4 images read of 5)."""
    assert list(hits[:2]) == [0, 0] and hits[3] == 0
    assert hits[2] == prompts[2].images[0].start  # the text before the image
    assert hits[4] >= prompts[4].images[0].end  # the whole first turn, its image too
    assert vision["images"] == 4  # all but the re-sent one


Runs = tuple[list[PromptIds], list[tuple[list[int], int]], dict[str, Any]]


def run_conversations(
    checkpoint: Path,
    config: EngineConfig,
    conversations: Sequence[list[Any]],
    one_by_one: bool,
    max_tokens: int,
    chat_template_kwargs: dict[str, Any],
) -> Runs:
    """Each conversation rendered by the engine's model, its greedy (tokens, cached
    tokens); the engine's stats. The model loads on the engine's thread, as a server's."""

    async def main() -> Runs:
        engine = await started_engine(config, lambda: load(checkpoint))
        requests = [
            PromptRequest(m, chat_template_kwargs=chat_template_kwargs) for m in conversations
        ]
        prompts = [render_prompt(engine.model, r) for r in requests]
        try:
            runs = await submit_prompts(engine, prompts, max_tokens, one_by_one)
            results = [(tokens_of(events), events[-1].cached_tokens) for events in runs]
            return prompts, results, engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def chunk_inputs(model: LoadedModel, prompt: PromptIds, start: int, end: int) -> tuple[Any, Any]:
    """The ids the language model reads at [start, end) of `prompt` and their input
    embeddings (None: no image there), as the engine feeds that chunk."""
    request = Request("oracle", list(prompt.token_ids), SamplingParams(), 0.0)
    request.images = prompt.images
    vision = VisionInputs(model.vision)
    ids = mx.array([vision.model_ids(request, start, end)], dtype=mx.int32)
    return ids, vision.embeddings(request, start, end)
