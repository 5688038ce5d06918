"""One calling convention over mlx-lm and mlx-vlm language models.

mlx-lm models return logits as an array; mlx-vlm's DeepSeek-V4 language model
returns a `LanguageModelOutput`. The engine also wants logits for the last
position only during prefill: projecting every prompt position through a
129k-row lm_head costs far more than the rest of a tiny model's prefill.

Loading wraps the modules our batched caches need: DeepSeek-V4's overlap
compressors (`deepseek_v4/overlap.py`) and DeepSeek-V4.1's attention (`deepseek_v4/v41_batch.py`,
so V4.1 requests decode as one batch, each row at its own position), and
on the CPU backend a float32 lm_head (`cpu_head`: same logits, faster). A V4.1
vision checkpoint's embedding and routers come wrapped from the loader
(`deepseek_v4/v41_image_route.py`): a chunk with images is fed through their feed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxserve.models import cpu_head
from mlxserve.models.compile_scope import uncompiled_unless_bounded
from mlxserve.models.deepseek_v4 import v41_image_route

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
            from mlxserve.models.deepseek_v4 import overlap as dsv4_overlap

            dsv4_overlap.install(module)
        elif model_type == "deepseek_v41":
            from mlxserve.models.deepseek_v4 import v41_batch as dsv41_batch

            dsv41_batch.install(module)
        cpu_head.install(module)

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, sink: list[Any] | None = None
    ) -> mx.array:
        """(B, L, V) logits. With `sink` (DeepSeek-V4 only), the last hidden states
        before the hyper-connection head, (B, L, hc_mult, hidden), are appended to
        it: what the checkpoint's MTP head reads (`models/mtp.py`)."""
        with uncompiled_unless_bounded(inputs.shape[1]):
            return self._logits(inputs, cache, sink)

    def _logits(
        self, inputs: mx.array, cache: list[Any] | None, sink: list[Any] | None
    ) -> mx.array:
        if sink is not None:
            self._check_sink()
            return self.module(inputs, cache=cache, hidden_sink=sink).logits
        out = self.module(inputs, cache=cache)
        return out.logits if self._is_vlm_v4 else out

    def _check_sink(self) -> None:
        if not self._is_vlm_v4:
            raise ValueError(f"{self.model_type} does not expose its hidden states")

    def last_logits(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        sink: list[Any] | None = None,
        embeddings: mx.array | None = None,
    ) -> mx.array:
        """Logits of the last input position of each row, shape (B, V); `sink` as above.
        `embeddings` (B, L, hidden), a prompt with images: fed in place of the inputs'
        token embeddings (mlx-lm's `input_embeddings`)."""
        with uncompiled_unless_bounded(inputs.shape[1]):
            if embeddings is not None:
                return self._embedded_last_logits(inputs, cache, embeddings)
            return self._last_logits(inputs, cache, sink)

    def _embedded_last_logits(
        self, inputs: mx.array, cache: list[Any] | None, embeddings: mx.array
    ) -> mx.array:
        if self._is_vlm_v4:
            # `inputs` hold the image sentinels: its gates and attention mask read them,
            # at whatever offset the chunk starts (`deepseek_v4/image_chunk.py`).
            from mlxserve.models.deepseek_v4.image_chunk import chunk_hidden

            if cache is None:
                raise ValueError("a DeepSeek-V4 chunk with images is fed over a cache")
            hidden = chunk_hidden(self.module.model, inputs, cache, embeddings)[:, -1:, :]
            return self.module.lm_head(hidden)[:, -1, :]
        feed = v41_image_route.image_feed(self.module)
        if feed is not None:
            # mlx-lm's V4.1 takes no input embeddings: its wrapped embedding and gates
            # read them, and the image mask, from the feed (`deepseek_v4/v41_image_route.py`).
            hidden = feed.hidden(self.module, inputs, cache, embeddings)[:, -1:, :]
            return self._head(hidden)[:, -1, :]
        if self.model_type not in _PLAIN_HEAD_TYPES or self.model_type == "deepseek_v41":
            raise ValueError(f"{self.model_type} takes no input embeddings here")
        hidden = self.module.model(inputs, cache, embeddings)[:, -1:, :]
        return self._head(hidden)[:, -1, :]

    def _head(self, hidden: mx.array) -> mx.array:
        tied = getattr(getattr(self.module, "args", None), "tie_word_embeddings", False)
        if tied or not hasattr(self.module, "lm_head"):
            return self.module.model.embed_tokens.as_linear(hidden)
        return self.module.lm_head(hidden)

    def _last_logits(
        self, inputs: mx.array, cache: list[Any] | None, sink: list[Any] | None
    ) -> mx.array:
        if sink is not None:
            self._check_sink()
        if self._is_vlm_v4:
            # mlx-vlm's `linear` is the module's own call for one position per row.
            hidden = self.module.model(inputs, cache=cache, hidden_sink=sink)[:, -1:, :]
            return self.module.lm_head(hidden)[:, -1, :]
        if self.model_type in _PLAIN_HEAD_TYPES:
            hidden = self.module.model(inputs, cache)[:, -1:, :]
            return self._head(hidden)[:, -1, :]
        return self._logits(inputs, cache, None)[:, -1, :]

    def make_cache(self) -> list[Any]:
        if self._is_vlm_v4:
            from mlxserve.models.deepseek_v4 import overlap as dsv4_overlap

            return dsv4_overlap.make_cache(self.module)
        if hasattr(self.module, "make_cache"):
            return list(self.module.make_cache())
        from mlx_lm.models.cache import make_prompt_cache

        return list(make_prompt_cache(self.module))
