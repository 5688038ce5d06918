"""Shard a lazily loaded model over `mx.distributed` ranks, before its weights are read.

`load(..., shard=Sharding(mode, group))` calls this between building the module
(lazy weights) and materialising them, so each rank reads only its shard:

- tensor: the module's own `shard(group)` (mlx-lm llama/qwen3, mlx-vlm's
  DeepSeek-V4 language model): attention heads and MLP columns split,
  results summed inside each layer.
- pipeline: the module's own `model.pipeline(group)` where it has one
  (mlx-lm deepseek_v41, mlx-vlm deepseek_v4); mlx-lm 0.32.2's llama and qwen3
  have none, so `PipelineStack` (below) runs their layers in stages the same
  way: the last rank runs the first layers, rank 0 the last, and the hidden
  state passes from stage to stage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve.models.loaded import ModelLoadError

logger = logging.getLogger(__name__)

MODES = ("tensor", "pipeline")
# Families whose pipeline stages this module builds (mlx-lm has no `pipeline` for them).
OWN_PIPELINE = frozenset({"llama", "qwen3"})
# Families refused in a mode, and why (parity tests decide: tests/test_distributed*.py).
REFUSED: dict[tuple[str, str], str] = {
    ("deepseek_v41", "tensor"): (
        "mlx-lm's deepseek_v41 has no tensor-parallel sharding (its layers share "
        "compressed KV across heads); serve it with --distributed pipeline"
    ),
}


def even_split(layers: int, ranks: int) -> list[int]:
    """Layers per rank, the low ranks taking the extra ones (as mlx-lm splits)."""
    base, extra = divmod(layers, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


class PipelineStack(nn.Module):
    """One rank's stage of a llama/qwen3 decoder stack (mlx-lm's `PipelineMixin` order).

    It takes the place of the mlx-lm model's `model` (the `LlamaModel`/`Qwen3Model`)
    and keeps only this rank's layers, so the others' weights are never read.
    Rank `size - 1` embeds the tokens and runs the first layers; each rank sends
    its output to the next lower rank; rank 0 runs the last layers, and every
    rank gets the final hidden state (an `all_gather`, so each runs the head).
    """

    def __init__(self, inner: Any, group: Any) -> None:
        super().__init__()
        self.rank, self.size = int(group.rank()), int(group.size())
        self._group = group
        layers = list(inner.layers)
        split = even_split(len(layers), self.size)
        self.start_idx = sum(split[self.rank + 1 :])
        self.end_idx = self.start_idx + split[self.rank]
        self.embed_tokens = inner.embed_tokens
        self.norm = inner.norm
        self.layers = layers[self.start_idx : self.end_idx]
        if any(getattr(layer, "use_sliding", False) for layer in self.layers):
            raise ModelLoadError("pipeline stages of sliding-window llama models are not supported")

    def __call__(
        self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        if self.rank < self.size - 1:
            h = mx.distributed.recv_like(h, self.rank + 1, group=self._group)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, mask, layer_cache)
        if self.rank != 0:
            h = mx.distributed.send(h, self.rank - 1, group=self._group)
            last = cache[-1]
            if last is not None:
                # Evaluating the cache alone (a chunk that does not end its prompt)
                # must still send this stage's output on.
                last.keys = mx.depends(last.keys, h)
        h = mx.distributed.all_gather(h, group=self._group)[: h.shape[0]]
        return self.norm(h)


@dataclass(frozen=True)
class Sharding:
    """Which mode, over which group; called by `load` on the lazily built module."""

    mode: str
    group: Any

    def __call__(self, module: Any, model_type: str) -> None:
        if self.mode not in MODES:
            raise ModelLoadError(f"--distributed must be one of {', '.join(MODES)}")
        refused = REFUSED.get((model_type, self.mode))
        if refused is not None:
            raise ModelLoadError(f"{model_type} cannot be served with --distributed {self.mode}: {refused}")
        rank, size = int(self.group.rank()), int(self.group.size())
        if self.mode == "tensor":
            if not hasattr(module, "shard"):
                raise ModelLoadError(f"{model_type} has no tensor-parallel sharding")
            module.shard(self.group)
        else:
            inner = getattr(module, "model", None)
            if model_type in OWN_PIPELINE and inner is not None:
                module.model = PipelineStack(inner, self.group)
            elif inner is not None and hasattr(inner, "pipeline"):
                inner.pipeline(self.group)
            else:
                raise ModelLoadError(f"{model_type} has no pipeline-parallel stages")
        logger.info("rank %d of %d: %s-parallel shard of %s", rank, size, self.mode, model_type)
