"""`mlxserve bench images`: an agent's screenshots, cold and re-sent, on a vision checkpoint.

One round is two turns of an agent session. The first turn holds a long text
history, then `--images` screenshots and a question: its TTFT is
`image_prefill_s` (the whole prefill, the vision tower included). The second
turn re-sends all of it with the assistant's reply and a new question, as an
agent does every turn: its TTFT over the first's is `resend_ttft_over_cold`,
which the prefix cache (image positions keyed by content) must bring to 0.1 or
less, the tower skipped (`resend_tower_images`). `vision_tower_ms_per_image` is
the tower's own time per image, from the engine's counters. Each round uses new
history and images, so no round hits another's entries; figures are medians over rounds.

The default checkpoint is the tiny LLaVA of `make-model --family llama --vision`;
`--model` takes any checkpoint that reads images (a DeepSeek-V4 one renders without
thinking, so that the next turn's prompt extends the first's).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from mlxserve.bench.report import emit
from mlxserve.chat import PromptIds, PromptRequest, render_prompt
from mlxserve.chat.images import ImageInput, ImageLimits, ImagePart, check_image
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import SamplingParams
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel

REPLY_TOKENS = 4
# The warm-up's images and history: far from any round's seeds.
WARM_UP_SEED = 1_000_000
# A screenshot's size before the processor resizes it (a laptop window).
SCREENSHOT_SIZE = (640, 400)
_LOG_LINE = "the build failed because a test in the parser module expects a newline"


def screenshot(seed: int, size: tuple[int, int] = SCREENSHOT_SIZE) -> ImagePart:
    """A PNG of seeded noise, checked as a route checks a client's image."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    return check_image(ImageInput(where="bench", url=url), ImageLimits())


def history_text(model: LoadedModel, tokens: int, session: int) -> str:
    """Log-like text of about `tokens` tokens (a tool's output the agent keeps); its first
    line names the session, so no two sessions share a cached prefix."""
    lines = [f"session {session}"]
    words_of_log = _LOG_LINE.split(" ")
    line = 0
    while True:
        words = " ".join(words_of_log[(line + i) % len(words_of_log)] for i in range(12))
        lines.append(f"{line:05d} {words}")
        line += 1
        if line % 32 == 0 and len(model.tokenizer.encode("\n".join(lines))) >= tokens:
            return "\n".join(lines)


def turns(model: LoadedModel, history: str, images: list[ImagePart]) -> tuple[PromptIds, ...]:
    """The first turn (history, screenshots, a question) and the next one re-sending it."""
    first: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": history}, *images]},
        {"role": "user", "content": "What do these screenshots show?"},
    ]
    second = [
        *first,
        {"role": "assistant", "content": "A failing build."},
        {"role": "user", "content": "Which test fails?"},
    ]
    no_thinking = {"thinking": False}  # DeepSeek: a template ignores it
    return tuple(
        render_prompt(model, PromptRequest(m, chat_template_kwargs=no_thinking))
        for m in (first, second)
    )


class Timed(NamedTuple):
    ttft: float
    cached: int  # prompt tokens the prefix cache served


async def timed(engine: AsyncEngine, prompt: PromptIds) -> Timed:
    params = SamplingParams(max_tokens=REPLY_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    ttft, cached = 0.0, 0
    async for event in engine.submit(prompt.token_ids, params, images=prompt.images):
        if event.token_id is not None and not ttft:
            ttft = time.perf_counter() - start
        cached = event.cached_tokens
    return Timed(ttft, cached)


async def _rounds(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    # Loaded on the engine's owner thread, as a server loads it (DeepSeek-V4 needs it).
    engine = AsyncEngine(EngineConfig(), lambda: load(path))
    engine.start()
    await engine.wait_ready()
    model = engine.model
    if not model.reads_images:
        await engine.shutdown()
        raise ValueError(f"{path} has no vision tower")
    cold, warm, tower_ms, cached, tower_on_resend = [], [], [], [], []
    try:
        # Warm-up: the first forwards of each shape pay one-off costs.
        warm_up = history_text(model, 64, session=WARM_UP_SEED)
        await timed(engine, turns(model, warm_up, [screenshot(WARM_UP_SEED)])[0])
        for n in range(args.rounds):
            history = history_text(model, args.history_tokens, session=n)
            images = [screenshot(n * args.images + i) for i in range(args.images)]
            first, second = turns(model, history, images)
            before = engine.stats()["vision"]
            cold.append((await timed(engine, first)).ttft)
            after = engine.stats()["vision"]
            encoded = after["images"] - before["images"]
            tower_ms.append(1000 * (after["seconds"] - before["seconds"]) / encoded)
            resent = await timed(engine, second)
            warm.append(resent.ttft)
            cached.append(resent.cached)
            tower_on_resend.append(engine.stats()["vision"]["images"] - after["images"])
    finally:
        await engine.shutdown()
    image_tokens = sum(image.length for image in first.images)
    return {
        "rounds": args.rounds,
        "images_per_prompt": args.images,
        "image_tokens_per_prompt": image_tokens,
        "cold_prompt_tokens": len(first.token_ids),
        "resend_prompt_tokens": len(second.token_ids),
        "resend_cached_tokens": min(cached),
        "resend_tower_images": max(tower_on_resend),
        "image_prefill_s": statistics.median(cold),
        "resend_ttft_s": statistics.median(warm),
        "resend_ttft_over_cold": statistics.median(w / c for w, c in zip(warm, cold, strict=True)),
        "vision_tower_ms_per_image": statistics.median(tower_ms),
    }


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
        else:
            from mlxserve.models.tiny.vision import make_vision_model

            path = make_vision_model(Path(tmp) / "llava", "llama", seed=0)
        figures: dict[str, Any] = {"model": str(args.model or "tiny llava")}
        try:
            figures.update(asyncio.run(_rounds(path, args)))
        except ValueError as e:
            print(f"mlxserve bench images: {e}", file=sys.stderr)
            return 2
    emit("images", figures, args.json)
    return 0
