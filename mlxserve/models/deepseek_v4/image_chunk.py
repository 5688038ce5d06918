"""DeepSeek-V4's forward over a prefill chunk holding image blocks, at any cache offset.

mlx-vlm 0.7.10's `DeepseekV4Model.__call__` reads image sentinels (ids past the
vocabulary) only in a forward from position 0: over a cache it raises, so a prompt
would have to be fed from its start to its last image in one forward. What the
sentinels change is local, though:

- the sliding-window mask: a position inside an image block (start sentinel to end
  sentinel) also sees the block's positions after it and, past the window, back to
  the block's start (`create_image_attention_mask`). Text positions keep the plain
  window, so the keys a chunk takes from the cache (the window before the chunk)
  are masked as the cache's own mask masks them (`combine_image_attention_mask`
  keeps those columns of the cache's mask);
- the layers' `causal` flag, which only picks mlx-vlm's token-by-token path for
  short chunks (decode blocks), whose per-token masks know nothing of images: a
  chunk with images takes the one-mask path, as mlx-vlm's own prefill does;
- the MoE gates, which read the ids themselves (passed to every layer as they are).

The pooled (compressed) caches never see the image mask: their mask is causal over
whole windows of 4 (`PoolingCache.make_mask`), and they carry a window's remainder
across calls (with our overlap carry, `overlap.py`), so a chunk may start anywhere.
The processor pads the front of each image block so that its rows start on a multiple
of 4 (no pooled window mixes text and image rows); that is the prompt's layout, which
does not depend on where chunks end (a chunk may start at 5 or 27 as well as at 28).

So a chunk whose every image block lies whole inside it computes what one forward
from position 0 computes: `chunk_hidden` is mlx-vlm's forward over its public
modules (embedding in, layers, norm, hyper-connection head) with that mask, and the
scheduler never cuts an image block (`Request.image_spans`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

# mlx-vlm's block types (`processing_deepseek_v4.py`): vocab_size + type is the sentinel.
IMAGE_START_TYPE, IMAGE_END_TYPE = 0, 4


def cut_block_error(ids: np.ndarray, vocab_size: int) -> str | None:
    """Why `ids` (B, L) cannot be fed as one chunk: an image block that starts or ends
    outside it (None when every block lies whole inside the chunk)."""
    for row in ids:
        starts = np.nonzero(row == vocab_size + IMAGE_START_TYPE)[0]
        ends = np.nonzero(row == vocab_size + IMAGE_END_TYPE)[0]
        if len(starts) != len(ends) or np.any(starts >= ends):
            return "an image block is cut by the chunk's edge"
        if len(starts) > 1 and np.any(starts[1:] <= ends[:-1]):
            return "image blocks overlap"
    return None


def image_chunk_mask(model: Any, inputs: mx.array, cache: list[Any]) -> mx.array:
    """(B, 1, L, keys) bool: the local attention mask of a chunk `inputs` (B, L) holding
    whole image blocks, over the keys the first layer's sliding-window cache returns
    (its retained window, then the chunk). mlx-vlm's own mask functions, pinned with
    mlx-vlm 0.7.10: the cache's window mask for the cached columns, the image mask
    (window + two-way image visibility) for the chunk's own."""
    from mlx_vlm.models.cache import CacheList
    from mlx_vlm.models.deepseek_v4.language import (
        combine_image_attention_mask,
        create_image_attention_mask,
    )

    args = model.args
    local = cache[0][0] if isinstance(cache[0], CacheList) else cache[0]
    length = inputs.shape[1]
    if local is not None:
        base = local.make_mask(length, window_size=args.sliding_window, return_array=True)
    else:
        from mlx_vlm.models.base import create_causal_mask

        base = create_causal_mask(length, window_size=args.sliding_window)
    image = create_image_attention_mask(
        inputs, args.vocab_size, args.sliding_window, args.vision_max_n_token
    )
    image_rows = mx.any(inputs >= args.vocab_size, axis=1)
    return combine_image_attention_mask(base, image, image_rows)


def chunk_hidden(model: Any, inputs: mx.array, cache: list[Any], embeddings: mx.array) -> mx.array:
    """(B, L, hidden) final hidden states of a chunk whose image blocks lie whole inside
    it, fed over `cache` at any offset (`model`: mlx-vlm's `DeepseekV4Model`)."""
    if model.pipeline_size > 1:
        raise ValueError("DeepSeek-V4 images are not read under pipeline parallelism")
    problem = cut_block_error(np.array(inputs), model.args.vocab_size)
    if problem is not None:
        raise ValueError(problem)
    mask = image_chunk_mask(model, inputs, cache)
    hc_mult = model.args.hc_mult
    batch, length, hidden = embeddings.shape
    h = mx.contiguous(mx.broadcast_to(embeddings[:, :, None, :], (batch, length, hc_mult, hidden)))
    for layer, layer_cache in zip(model.pipeline_layers, cache, strict=True):
        # causal=False: the full mask, never the per-token decode-block path (see above).
        h = layer(h, mask, layer_cache, inputs, causal=False)
    return model.norm(model.hc_head(h))
