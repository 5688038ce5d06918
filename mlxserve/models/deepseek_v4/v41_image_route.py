"""DeepSeek-V4.1's language model reading a prefill chunk with image positions.

mlx-lm 0.32.2's `deepseek_v41` is a text model: its `TextModel` embeds the ids it is
given and its MoE `Router` picks experts with one correction bias. mlx-vlm 0.7.10's
V4.1 (the checkpoint's vision model) changes two things at an image's positions
(its whole span, delimiters included, which hold `image_token_id`):

- the inputs are the image block's features (ViT + aligner rows, learnt delimiter
  rows), not token embeddings;
- each MoE gate adds `bias_vl` instead of `bias` before its top-k (the routing
  weights stay the unbiased scores). mlx-lm's sanitize drops `bias_vl`.

Attention stays causal, as for text (mlx-vlm's V4.1 has no two-way image mask, unlike
V4), so a chunk may end anywhere inside an image's span. Its engram tables, switched
off at image positions, exist in no checkpoint mlx-lm's V4.1 loads.

So `install` replaces two kinds of module (as `v41_batch.BatchableAttention` does):
the embedding becomes an `ImageEmbedding` and each router an `ImageRouter`, both
reading one `ImageFeed` that `ImageFeed.hidden` fills for the one forward of a chunk
with images and empties after. Without a feed (text prompts, every decode step:
generated tokens are text) both call the wrapped module unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class ImageFeed:
    """What the forward being run reads at image positions (None between forwards)."""

    def __init__(self, image_token_id: int) -> None:
        self.image_token_id = image_token_id
        self.embeddings: mx.array | None = None
        self.image_mask: mx.array | None = None

    @contextmanager
    def feeding(self, embeddings: mx.array, image_mask: mx.array) -> Iterator[None]:
        self.embeddings, self.image_mask = embeddings, image_mask
        try:
            yield
        finally:
            self.embeddings = self.image_mask = None

    def hidden(self, module: Any, inputs: mx.array, cache: Any, embeddings: mx.array) -> mx.array:
        """(B, L, hidden) final hidden states of mlx-lm's `TextModel` for ids `inputs`
        (B, L) fed as `embeddings`; positions holding `image_token_id` route by
        `bias_vl`, as mlx-vlm's `input_ids == image_token_id` mask does."""
        if embeddings.shape[:2] != inputs.shape:
            raise ValueError(f"embeddings {embeddings.shape} do not match ids {inputs.shape}")
        with self.feeding(embeddings, inputs == self.image_token_id):
            return module.model(inputs, cache)


class ImageEmbedding(nn.Module):
    """The token embedding, or the feed's embeddings while a chunk with images runs."""

    def __init__(self, inner: nn.Module, feed: ImageFeed) -> None:
        super().__init__()
        self.inner = inner
        self._feed = feed  # underscore: not a parameter

    @property
    def feed(self) -> ImageFeed:
        return self._feed

    def __call__(self, ids: mx.array) -> mx.array:
        fed = self._feed.embeddings
        # The tower gave them the token embeddings' dtype (a quantized table's `weight`
        # is packed integers, so not read here).
        return self.inner(ids) if fed is None else fed


class ImageRouter(nn.Module):
    """mlx-lm 0.32.2's V4.1 `Router` with a second correction bias for image positions.

    Its math is restated from `Router.__call__` (pinned with mlx-lm 0.32.2; the test
    holds it equal to the wrapped router's output with no image, and to a router whose
    bias is `bias_vl` with only images)."""

    def __init__(self, inner: nn.Module, bias_vl: mx.array, feed: ImageFeed) -> None:
        super().__init__()
        self.inner = inner
        self.bias_vl = bias_vl.astype(mx.float32)
        self._feed = feed

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        mask = self._feed.image_mask
        if mask is None:
            return self.inner(x)
        return self.route(x, mask.reshape(-1))

    def route(self, x: mx.array, image_rows: mx.array) -> tuple[mx.array, mx.array]:
        """(experts, weights) of flat rows `x` (N, hidden); `image_rows` (N,) bool."""
        r = self.inner
        logits = x.astype(mx.float32) @ r.weight.astype(mx.float32).T
        logits = logits / r.gate_temp
        if r.score_func == "sigmoid":
            scores = mx.sigmoid(logits)
        elif r.score_func == "softmax":
            scores = mx.softmax(logits, axis=-1)
        else:
            scores = mx.sqrt(nn.softplus(logits))
        bias = mx.where(image_rows[:, None], self.bias_vl, r.e_score_correction_bias)
        chosen = mx.argpartition(-(scores + bias), r.top_k - 1, axis=-1)[..., : r.top_k]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if r.norm_topk_prob and r.top_k > 1:
            weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return chosen, weights * r.route_scale


def image_feed(language_model: Any) -> ImageFeed | None:
    """The feed `install` gave this model (None: it reads text only)."""
    embed = getattr(getattr(language_model, "model", None), "embed_tokens", None)
    return embed.feed if isinstance(embed, ImageEmbedding) else None


def install(language_model: Any, bias_vl: Sequence[mx.array], image_token_id: int) -> ImageFeed:
    """Wrap the embedding and every layer's router of an mlx-lm `deepseek_v41.Model`
    (`bias_vl`: one per layer, from the checkpoint); returns the feed they read."""
    text = language_model.model
    if len(bias_vl) != len(text.layers):
        raise ValueError(f"{len(bias_vl)} bias_vl tensors for {len(text.layers)} layers")
    if isinstance(text.embed_tokens, ImageEmbedding):
        raise ValueError("this model already reads images")
    feed = ImageFeed(image_token_id)
    text.embed_tokens = ImageEmbedding(text.embed_tokens, feed)
    for layer, bias in zip(text.layers, bias_vl, strict=True):
        layer.mlp.gate = ImageRouter(layer.mlp.gate, bias, feed)
    return feed
