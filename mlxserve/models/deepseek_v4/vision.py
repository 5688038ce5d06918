"""DeepSeek-V4's vision tower (mlx-vlm's `deepseek_v4` with `vision_n_layers > 0`).

mlx-vlm's processor replaces each `<｜deepseek_image｜>` placeholder by a block of
sentinel ids, `vocab_size + type` (type: start, pad, image, newline, end): a few
pads first, so that the block's start lands on a multiple of 4 (the compressed
caches pool 4 positions), then the image's rows. The language model reads those
sentinels: its MoE gates route image positions by their own bias, and it lets the
positions of one image see each other both ways. So the prompt's positions hold
content-keyed ids (the prefix cache's keys, `models/vision.py`), each image keeps
its sentinels as `PromptImage.model_ids` (what the language model is fed), and
the tower is `whole_images`: a position inside an image block attends to the block's
later positions, so the engine never ends a prefill chunk inside a block. A chunk
holding blocks may start anywhere over the cache (`image_chunk.py` builds its mask,
where mlx-vlm's model takes sentinels only from position 0).

An image's features are its whole block, as mlx-vlm's own merge builds it: the
ViT and aligner output in the image positions, the learnt start, pad, newline and
end rows in the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxserve.models.vision import (
    PromptImage,
    VisionError,
    VisionTower,
    decode_image,
    image_key_ids,
)

# mlx-vlm's block types (`processing_deepseek_v4.py`): vocab_size + type is the sentinel.
IMAGE_START, IMAGE_PAD, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(5)


class DeepseekV4Tower(VisionTower):
    whole_images = True
    # mlx-vlm's processor renders a content list as its parts with nothing between.
    placeholder_joins_text = True

    def __init__(self, vlm: Any, processor: Any, vocab_size: int) -> None:
        from mlx_vlm.models.deepseek_v4.processing_deepseek_v4 import IMAGE_PLACEHOLDER

        self.vlm = vlm
        self.processor = processor
        self.vocab_size = vocab_size
        self.image_token = IMAGE_PLACEHOLDER
        self.image_token_id = int(processor.tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER))

    # -- the render worker thread ----------------------------------------------
    def prepare(
        self, text: str, images: Sequence[tuple[bytes, str]]
    ) -> tuple[list[int], list[PromptImage]]:
        self.check_placeholders(text, images)
        if not images:
            out = self.processor.tokenizer.encode(text, add_special_tokens=False)
            return [int(i) for i in out], []
        pictures = [decode_image(data) for data, _ in images]
        out = self.processor(text=[text], images=pictures, return_tensors="np")
        ids = [int(i) for i in out["input_ids"].reshape(-1)]
        placed = []
        patches_at = feature_at = 0
        ends = [int(e) for e in out["image_type_offsets"]]
        for n, (_, digest) in enumerate(images):
            start, types = int(out["image_offsets"][n]), out["image_types"][ends[n] : ends[n + 1]]
            height, width = (int(v) for v in out["image_grid_hw"][n])
            features = int((types == IMAGE).sum())
            pixels = out["pixel_values"][patches_at : patches_at + height * width]
            order = out["image_permutations"][feature_at : feature_at + features]
            patches_at, feature_at = patches_at + height * width, feature_at + features
            model_ids = tuple(int(t) + self.vocab_size for t in types)
            if tuple(ids[start : start + len(types)]) != model_ids:
                raise VisionError("the processor's image layout does not match its prompt")
            ids[start : start + len(types)] = image_key_ids(digest, len(types))
            layout = (height, width, np.asarray(order))
            placed.append(PromptImage(start, len(types), digest, pixels, model_ids, layout))
        return ids, placed

    # -- the owner thread --------------------------------------------------------
    def features(self, image: PromptImage) -> Any:
        """(length, hidden): the image's whole block, as mlx-vlm's merge writes it."""
        import mlx.core as mx

        height, width, order = image.layout
        encoded = self.vlm.encode_image(mx.array(image.pixels), height, width)
        encoded = encoded[mx.array(order)]
        vlm = self.vlm
        # mlx-vlm's merge gives the block the token embeddings' dtype.
        dtype = vlm.language_model.model.embed_tokens(mx.array([0], dtype=mx.int32)).dtype
        rows = [vlm.image_start, vlm.image_pad, vlm.image_pad, vlm.image_newline, vlm.image_end]
        learnt = mx.stack(rows).astype(dtype)
        types = np.asarray(image.model_ids) - self.vocab_size
        block = learnt[mx.array(types)]
        block[mx.array(np.nonzero(types == IMAGE)[0])] = encoded.astype(dtype)
        return block
