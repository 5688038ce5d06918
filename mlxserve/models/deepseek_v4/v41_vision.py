"""DeepSeek-V4.1's vision tower (mlx-vlm 0.7.10's `deepseek_v41` with `vision_num_layers > 0`).

mlx-vlm's processor expands each `<｜deepseek_image｜>` placeholder (the tokenizer's
`image_token_id`) into the image's span: `image_token_id` at every position, and a
layout of types beside it (start, the aligner grid's rows each closed by a newline,
end). The span's features are its whole block, as mlx-vlm's own
`merge_image_embeddings` writes them: the ViT + aligner rows at the image positions,
the learnt start, newline and end rows at the delimiters.

The language model served is mlx-lm's V4.1 (our batching, `v41_batch.py`), reading a
chunk with image positions through `v41_image_route.py`: the block's rows as inputs,
`bias_vl` in the MoE gates. Attention stays causal (V4.1 has no two-way image mask, so
the tower is not `whole_images`): a prefill chunk may end anywhere inside an image's
span, and the next chunk goes on with the rest of the block's rows
(`engine/vision_inputs.py` keeps the features until a chunk passes the span's end).

The prompt's positions hold content-keyed ids (the prefix cache's keys,
`models/vision.py`); each image keeps `image_token_id` per position as
`PromptImage.model_ids`, what the language model is fed and its gates' image mask reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlxserve.models.vision import (
    PromptImage,
    VisionError,
    VisionTower,
    decode_image,
    image_key_ids,
)


class DeepseekV41Tower(VisionTower):
    """mlx-vlm's V4.1 processor, ViT and aligner beside mlx-lm's language model."""

    def __init__(self, vlm: Any, processor: Any, embed_tokens: Any) -> None:
        from mlx_vlm.models.deepseek_v41.processing_deepseek_v41 import IMAGE_PLACEHOLDER

        self.vlm = vlm
        self.processor = processor
        # The language model's own token embedding (mlx-lm's, unwrapped).
        self.embed_tokens = embed_tokens
        self.image_token = IMAGE_PLACEHOLDER
        self.image_token_id = int(vlm.config.image_token_id)
        placeholder = processor.tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
        if placeholder != self.image_token_id:
            raise ValueError(
                f"the tokenizer reads {IMAGE_PLACEHOLDER!r} as {placeholder}, the config's "
                f"image_token_id is {self.image_token_id}"
            )

    # -- the render worker thread ----------------------------------------------
    def prepare(
        self, text: str, images: Sequence[tuple[bytes, str]]
    ) -> tuple[list[int], list[PromptImage]]:
        self.check_placeholders(text, images)
        if not images:
            out = self.processor.tokenizer.encode(text, add_special_tokens=False)
            return [int(i) for i in out], []
        pictures = [decode_image(data) for data, _ in images]
        out = self.processor(text=[text], images=pictures)
        ids = [int(i) for i in np.array(out["input_ids"]).reshape(-1)]
        placed = []
        for record, (_, digest) in zip(out["pixel_values"][0], images, strict=True):
            start, length = int(record.start), len(record.types)
            if ids[start : start + length] != [self.image_token_id] * length:
                raise VisionError("the processor's image span does not match its prompt")
            ids[start : start + length] = image_key_ids(digest, length)
            # mlx-vlm's processor hands back patches as an MLX array made from numpy (no
            # computation): numpy again at once, as `PromptImage` holds.
            pixels = np.array(record.patches)
            layout = (int(record.n_vit_h), int(record.n_vit_w), tuple(record.types))
            model_ids = (self.image_token_id,) * length
            placed.append(PromptImage(start, length, digest, pixels, model_ids, layout))
        return ids, placed

    # -- the owner thread --------------------------------------------------------
    def features(self, image: PromptImage) -> Any:
        """(length, hidden): the image's whole block, through mlx-vlm's own merge (every
        position of a span is an image row or a delimiter, so the merge writes them all)."""
        import mlx.core as mx
        from mlx_vlm.models.deepseek_v41.processing_deepseek_v41 import ImageInput

        height, width, types = image.layout
        record = ImageInput(0, mx.array(image.pixels), height, width, list(types))
        blank = mx.zeros((1, image.length, self.vlm.config.hidden_size), dtype=self._dtype())
        return self.vlm.merge_image_embeddings([[record]], blank)[0]

    def _dtype(self) -> Any:
        """The token embeddings' dtype: mlx-vlm's merge casts the block to it."""
        import mlx.core as mx

        return self.embed_tokens(mx.array([0], dtype=mx.int32)).dtype

    def feature_bytes_per_position(self) -> int:
        import mlx.core as mx

        return int(self.embed_tokens(mx.array([0], dtype=mx.int32)).nbytes)

    def embeddings(self, ids: Sequence[int], start: int, parts: Sequence[tuple[int, Any]]) -> Any:
        """As `VisionTower.embeddings`, with the language model's own token embedding."""
        import mlx.core as mx

        pieces = []
        pos, end = start, start + len(ids)
        for at, rows in sorted(parts, key=lambda p: p[0]):
            if pos < at:
                pieces.append(self.embed_tokens(mx.array(list(ids[pos - start : at - start]))))
            pieces.append(rows)
            pos = at + rows.shape[0]
        if pos < end:
            pieces.append(self.embed_tokens(mx.array(list(ids[pos - start :]))))
        dtype = self._dtype()
        return mx.concatenate([p.astype(dtype) for p in pieces], axis=0)[None]


def load_v41_vision(path: Path) -> tuple[Any, Any, list[Any]]:
    """(mlx-lm's V4.1 language model, mlx-vlm's model holding only the tower, each layer's
    `bias_vl`), all lazy until evaluated.

    mlx-vlm's own language model is read for its gates' `bias_vl` (its sanitize keeps
    them, under whatever names and format the checkpoint has), then set aside: the one
    served is mlx-lm's, whose arrays mlx-lm's loader reads."""
    from mlx_lm.utils import load_model as lm_load_model
    from mlx_vlm.utils import load_model as vlm_load_model

    language, _ = lm_load_model(path, lazy=True)
    vlm = vlm_load_model(path, lazy=True)
    bias_vl = [layer.ffn.gate.bias_vl for layer in vlm.language_model.layers]
    # mlx-vlm's tower (`encode_image`, `merge_image_embeddings`) never reads it.
    vlm.language_model = None
    return language, vlm, bias_vl
