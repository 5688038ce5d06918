"""One calling convention over mlx-lm and mlx-vlm language models.

mlx-lm models return logits as an array; mlx-vlm's DeepSeek-V4 language model
returns a `LanguageModelOutput`. The engine also wants logits for the last
position only during prefill: projecting every prompt position through a
129k-row lm_head costs far more than the rest of a tiny model's prefill.

Loading wraps the modules our batched caches need: DeepSeek-V4's overlap
compressors (`dsv4_overlap`) and DeepSeek-V4.1's attention (`dsv41_batch`,
so V4.1 requests decode as one batch, each row at its own position).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

# mlx-lm families whose __call__ is exactly `head(model.model(inputs, cache))`,
# so the head can be applied to the last position alone.
_PLAIN_HEAD_TYPES = frozenset(
    {"llama", "qwen2", "qwen3", "mistral", "deepseek_v41", "phi3", "starcoder2"}
)


class ModelAdapter:
    """`adapter(inputs, cache)` -> (B, L, V) logits; `last_logits` -> (B, V)."""

    def __init__(self, module: Any, model_type: str) -> None:
        self.module = module
        self.model_type = model_type
        self._is_vlm_v4 = model_type == "deepseek_v4"
        if self._is_vlm_v4:
            from mlxserve.models import dsv4_overlap

            dsv4_overlap.install(module)
        elif model_type == "deepseek_v41":
            from mlxserve.models import dsv41_batch

            dsv41_batch.install(module)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        out = self.module(inputs, cache=cache)
        return out.logits if self._is_vlm_v4 else out

    def last_logits(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        """Logits of the last input position of each row, shape (B, V)."""
        if self._is_vlm_v4:
            # mlx-vlm's `linear` is the module's own call for one position per row.
            hidden = self.module.model(inputs, cache=cache)[:, -1:, :]
            return _head(self.module.lm_head, hidden)[:, -1, :]
        if self.model_type in _PLAIN_HEAD_TYPES:
            hidden = self.module.model(inputs, cache)[:, -1:, :]
            tied = getattr(getattr(self.module, "args", None), "tie_word_embeddings", False)
            if tied or not hasattr(self.module, "lm_head"):
                logits = self.module.model.embed_tokens.as_linear(hidden)
            else:
                logits = _head(self.module.lm_head, hidden)
            return logits[:, -1, :]
        return self(inputs, cache)[:, -1, :]

    def make_cache(self) -> list[Any]:
        if self._is_vlm_v4:
            from mlxserve.models import dsv4_overlap

            return dsv4_overlap.make_cache(self.module)
        if hasattr(self.module, "make_cache"):
            return list(self.module.make_cache())
        from mlx_lm.models.cache import make_prompt_cache

        return list(make_prompt_cache(self.module))


def _head(lm_head: Any, hidden: mx.array) -> mx.array:
    """`lm_head(hidden)` for (B, 1, H) hidden states.

    On the CPU backend (reference BLAS) a plain float head over several rows
    runs about twice as fast as `W @ h^T` as it does as `h @ W^T` (measured
    with a 129k-row head; bit-equal there). Decode batches spend
    most of a tiny model's step there. Used for mlx-lm's plain heads and
    DeepSeek-V4's (mlx-vlm's `linear` calls the module itself for one position).
    """
    weight = getattr(lm_head, "weight", None)
    rows = hidden.shape[0]
    if (
        type(lm_head) is not nn.Linear
        or "bias" in lm_head
        or weight is None
        or rows < 2
        or hidden.shape[1] != 1
        or mx.default_device() != mx.cpu
    ):
        return lm_head(hidden)
    flat = hidden.reshape(rows, hidden.shape[-1])
    return mx.swapaxes(weight @ mx.swapaxes(flat, 0, 1), 0, 1)[:, None, :]
