"""A checkpoint's vision tower: images into prompt positions and their input embeddings.

A vision checkpoint (mlx-vlm's `llava` family: a llama language model behind a
CLIP tower) loads as two parts. Its language model is mlx-lm's llama with the
checkpoint's weights, so the engine batches, caches and decodes it exactly as a
text llama. The rest is a `VisionTower`:

- `prepare` (the render worker thread) runs mlx-vlm's own processor over the
  rendered prompt text and the images: it expands each image placeholder to the
  image's token count and prepares its pixels. Each image's span of token ids is
  then replaced by ids derived from the image's sha256 (`image_key_ids`), so the
  prefix cache (RAM and disk, keyed by token ids) keys image positions by content
  (rule 13 of docs/architecture.md):
  the same image re-sent is a hit, a different one at the same positions is not.
  Those ids are at or above `IMAGE_KEY_BASE`, past any vocabulary, so they never
  stand for text.
- `features` and `embeddings` (the engine's owner thread, rule 1 of
  docs/architecture.md): the image's features through mlx-vlm's own merge, and a
  prefill chunk's input embeddings with them in place of the image positions.

DeepSeek-V4's tower (`models/deepseek_v4/vision.py`) is a `VisionTower` of its own: its
language model is mlx-vlm's, and it reads the processor's image sentinels too.
DeepSeek-V4.1's (`models/deepseek_v4/v41_vision.py`) sits beside mlx-lm's V4.1, whose
gates route image positions by their own bias (`models/deepseek_v4/v41_image_route.py`).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Prompt ids at or above this stand for image positions (see the module docstring).
IMAGE_KEY_BASE = 1 << 30
_KEY_MASK = IMAGE_KEY_BASE - 1
# mlx-vlm families loaded as language model + vision tower (DeepSeek-V4 when its config
# has `vision_n_layers > 0`, `models/deepseek_v4/vision.py`; V4.1 with `vision_num_layers
# > 0`, `models/deepseek_v4/v41_vision.py`).
VISION_TYPES = frozenset({"llava"})


def has_vision_tower(config: dict[str, Any]) -> bool:
    """Whether a checkpoint's config describes a vision tower mlxserve serves."""
    if config.get("model_type") == "deepseek_v4":
        return int(config.get("vision_n_layers") or 0) > 0
    if config.get("model_type") == "deepseek_v41":  # mlx-vlm's names, flat or nested
        nested = config.get("vision_config") or {}
        return int(config.get("vision_num_layers") or nested.get("num_hidden_layers") or 0) > 0
    return config.get("model_type") in VISION_TYPES


def image_key_ids(sha256: str, length: int) -> list[int]:
    """The prompt ids of an image's `length` positions: each one 30 bits of a hash of
    the image's hash and the position, so two images share no entry unless every
    position's bits agree."""
    out = []
    for position in range(length):
        digest = hashlib.sha256(f"{sha256}:{position}".encode()).digest()
        out.append(IMAGE_KEY_BASE + (int.from_bytes(digest[:4], "big") & _KEY_MASK))
    return out


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image's place in a prompt: positions [start, start + length), its content
    hash, and its pixels as the checkpoint's processor prepared them (numpy, so no
    MLX array is made outside the owner thread)."""

    start: int
    length: int
    sha256: str
    pixels: np.ndarray
    # What the language model reads at the image's positions beside the features (LLaVA:
    # its image token; DeepSeek-V4: the processor's layout sentinels); () for none.
    model_ids: tuple[int, ...] = ()
    # The family's own layout of the image (DeepSeek-V4: its patch grid and order).
    layout: tuple[Any, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.length


def text_ids(prompt_ids: Sequence[int], images: Sequence[PromptImage], model: Any) -> Sequence[int]:
    """The ids of `prompt_ids` at text positions (all of them without images), once
    `images` are checked to fit the prompt, apart, and a model that reads images
    (ValueError otherwise)."""
    if not images:
        return prompt_ids
    if getattr(model, "vision", None) is None:
        raise ValueError("this model reads text only; the prompt holds images")
    covered: set[int] = set()
    for image in images:
        span = range(image.start, image.end)
        if image.length < 1 or image.start < 0 or image.end > len(prompt_ids):
            raise ValueError("an image's positions fall outside the prompt")
        if covered.intersection(span):
            raise ValueError("two images share prompt positions")
        covered.update(span)
    return [token for i, token in enumerate(prompt_ids) if i not in covered]


class VisionError(ValueError):
    """A prompt the vision processor cannot place its images in (a 400)."""


class VisionTower:
    """The vision side of a loaded checkpoint (see the module docstring)."""

    # Whether the language model must read each image whole, inside one forward
    # (DeepSeek-V4's two-way attention inside an image block); LLaVA is causal.
    whole_images = False
    # Whether an image's placeholder joins its neighbouring text with no separator, as
    # the family's processor renders a content list holding images.
    placeholder_joins_text = False

    def __init__(self, vlm: Any, processor: Any, image_token_id: int) -> None:
        self.vlm = vlm
        self.processor = processor
        self.image_token_id = image_token_id
        self.image_token: str = processor.image_token

    # -- the render worker thread ----------------------------------------------
    def check_placeholders(self, text: str, images: Sequence[tuple[bytes, str]]) -> None:
        """VisionError unless `text` holds one placeholder per image (a message's own text
        holding the placeholder would take an image's place)."""
        placeholders = text.count(self.image_token)
        if placeholders != len(images):
            raise VisionError(
                f"the prompt holds {placeholders} image placeholder(s) "
                f"({self.image_token!r}) for {len(images)} image(s); a message's text may "
                "not contain the placeholder itself"
            )

    def prepare(
        self, text: str, images: Sequence[tuple[bytes, str]]
    ) -> tuple[list[int], list[PromptImage]]:
        """The prompt ids of `text` (each image placeholder expanded by the processor and
        keyed by content) and each image's place; `images` are (bytes, sha256) in order."""
        self.check_placeholders(text, images)
        pictures = [decode_image(data) for data, _ in images]
        # mlx-vlm's processors hand back MLX arrays made from numpy ones (no computation);
        # they become numpy again at once.
        out = self.processor(text=[text], images=pictures or None)
        ids = [int(i) for i in np.array(out["input_ids"]).reshape(-1)]
        if not images:
            return ids, []
        pixels = np.array(out["pixel_values"])
        spans = _spans(ids, self.image_token_id, len(images))
        placed = []
        for (start, length), (_, digest), one in zip(spans, images, pixels, strict=True):
            ids[start : start + length] = image_key_ids(digest, length)
            model_ids = (self.image_token_id,) * length
            placed.append(PromptImage(start, length, digest, one, model_ids))
        return ids, placed

    # -- the owner thread --------------------------------------------------------
    def features(self, image: PromptImage) -> Any:
        """(length, hidden) features of one image, through mlx-vlm's own merge: the
        image's placeholder run's input embeddings are its features."""
        import mlx.core as mx

        run = mx.array([[self.image_token_id] * image.length], dtype=mx.int32)
        pixels = mx.array(image.pixels[None])
        merged = self.vlm.get_input_embeddings(input_ids=run, pixel_values=pixels)
        return merged.inputs_embeds[0]

    def feature_bytes_per_position(self) -> int:
        """Bytes of one image position's features as the engine holds them (one row of
        input embeddings: mlx-vlm's merge gives them the token embeddings' dtype)."""
        import mlx.core as mx

        row = self.vlm.language_model.model.embed_tokens(mx.array([0], dtype=mx.int32))
        return int(row.nbytes)

    def embeddings(self, ids: Sequence[int], start: int, parts: Sequence[tuple[int, Any]]) -> Any:
        """(1, len(ids), hidden) input embeddings of prompt ids [start, start + len(ids)):
        token embeddings, with `parts` ((position, feature rows)) in their places."""
        import mlx.core as mx

        embed = self.vlm.language_model.model.embed_tokens
        pieces = []
        pos, end = start, start + len(ids)
        for at, rows in sorted(parts, key=lambda p: p[0]):
            if pos < at:
                pieces.append(embed(mx.array(list(ids[pos - start : at - start]), dtype=mx.int32)))
            pieces.append(rows)
            pos = at + rows.shape[0]
        if pos < end:
            pieces.append(embed(mx.array(list(ids[pos - start :]), dtype=mx.int32)))
        # mlx-vlm's merge casts the features to the token embeddings' dtype.
        dtype = embed(mx.array([0], dtype=mx.int32)).dtype
        return mx.concatenate([p.astype(dtype) for p in pieces], axis=0)[None]


def decode_image(data: bytes) -> Any:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.seek(0)  # a GIF's first frame
        return image.convert("RGB")


def _spans(ids: list[int], token: int, count: int) -> list[tuple[int, int]]:
    """(start, length) of each image's placeholder run; adjacent images' runs touch, so
    the placeholder positions are cut into `count` equal runs."""
    positions = [i for i, t in enumerate(ids) if t == token]
    if not positions or len(positions) % count:
        raise VisionError(
            f"the processor placed {len(positions)} image positions for {count} image(s)"
        )
    length = len(positions) // count
    spans = []
    for n in range(count):
        run = positions[n * length : (n + 1) * length]
        if run[-1] - run[0] != length - 1:
            raise VisionError("an image's positions are not one run")
        spans.append((run[0], length))
    return spans


def load_vision(path: Path, config: dict[str, Any]) -> tuple[Any, Any]:
    """(language module, mlx-vlm model) of a vision checkpoint: the language module is
    mlx-lm's own class for `text_config`, holding the very arrays of mlx-vlm's language
    model (nothing is copied); both are lazy until evaluated."""
    import dataclasses
    import importlib

    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model as vlm_load_model

    vlm = vlm_load_model(path, lazy=True)
    if config["model_type"] == "deepseek_v4":  # mlx-vlm's language model is the one served
        return vlm.language_model, vlm
    # A real checkpoint's text_config may leave fields to their defaults: mlx-vlm's
    # resolved config fills them, and the file's own keys (ones mlx-vlm ignores) stay.
    text_config = {**config["text_config"], **dataclasses.asdict(vlm.config.text_config)}
    arch = importlib.import_module(f"mlx_lm.models.{text_config['model_type']}")
    language = arch.Model(arch.ModelArgs.from_dict(text_config))
    language.load_weights(tree_flatten(vlm.language_model.parameters()), strict=True)
    return language, vlm


def load_tower(path: Path, vlm: Any, config: dict[str, Any]) -> VisionTower:
    """The processor (mlx-vlm's, from the checkpoint's files) and the tower around `vlm`."""
    from mlx_vlm.utils import load_processor

    processor = load_processor(path, add_detokenizer=False)
    return VisionTower(vlm, processor, int(config["image_token_index"]))
