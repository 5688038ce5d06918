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


def _gather_last(x: mx.array, group: Any) -> mx.array:
    """Concatenate each rank's `x` along the last axis (`all_gather` stacks on axis 0)."""
    size = int(group.size())
    every = mx.distributed.all_gather(x, group=group)
    every = every.reshape(size, *x.shape)
    return mx.moveaxis(every, 0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


class GatheredHead(nn.Module):
    """An lm_head split by vocabulary rows: each rank projects onto its slice of the
    vocabulary and the slices are gathered. Every logit is the same dot product as
    the whole head's (nothing is summed across ranks), so the logits are bit-equal."""

    def __init__(self, head: Any, group: Any) -> None:
        super().__init__()
        from mlx.nn.layers.distributed import shard_linear

        self._group = group
        self.part = shard_linear(head, "all-to-sharded", group=group)

    def __call__(self, x: mx.array) -> mx.array:
        return _gather_last(self.part(x), self._group)


class GatheredEmbedding(nn.Module):
    """An embedding table split by hidden columns: each rank looks up its columns and
    the columns are gathered (a copy, no sum: the same vectors as the whole table)."""

    def __init__(self, embedding: nn.Embedding, group: Any) -> None:
        super().__init__()
        rank, size = int(group.rank()), int(group.size())
        width = embedding.weight.shape[1] // size
        self._group = group
        self.weight = embedding.weight[:, rank * width : (rank + 1) * width]

    def __call__(self, x: mx.array) -> mx.array:
        return _gather_last(self.weight[x], self._group)


class NullHead(nn.Module):
    """A pipeline stage other than the last one computes no logits: it only has to
    send its hidden state on. Its "logits" are two columns of that (sent) state, so
    evaluating them sends it; what a follower draws from them is never used. (Two,
    not one: an argmax over a single column needs no input, and MLX skips it.)"""

    def __call__(self, x: mx.array) -> mx.array:
        return x[..., :2]


class PipelineStack(nn.Module):
    """One rank's stage of a llama/qwen3 decoder stack (mlx-lm's `PipelineMixin` order).

    It takes the place of the mlx-lm model's `model` (the `LlamaModel`/`Qwen3Model`)
    and keeps only this rank's layers, so the others' weights are never read.
    Rank `size - 1` embeds the tokens and runs the first layers; each rank sends
    its output to the next lower rank; rank 0 runs the last layers, the norm and
    the head. With untied embeddings no other rank holds the embedding (rank 0
    receives its input instead) and only rank 0 holds the head (the others get a
    `NullHead`: rank 0 alone samples), so a rank holds about 1/N of the weights.
    """

    def __init__(self, inner: Any, group: Any, lean: bool) -> None:
        super().__init__()
        self.rank, self.size = int(group.rank()), int(group.size())
        self._group = group
        layers = list(inner.layers)
        split = even_split(len(layers), self.size)
        self.start_idx = sum(split[self.rank + 1 :])
        self.end_idx = self.start_idx + split[self.rank]
        weight = inner.embed_tokens.weight
        self._hidden, self._dtype = int(weight.shape[1]), weight.dtype
        first = self.rank == self.size - 1
        self.embed_tokens = inner.embed_tokens if first or not lean else None
        self.norm = inner.norm
        self.layers = layers[self.start_idx : self.end_idx]
        if any(getattr(layer, "use_sliding", False) for layer in self.layers):
            raise ModelLoadError("pipeline stages of sliding-window llama models are not supported")

    def __call__(
        self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        if cache is None:
            cache = [None] * len(self.layers)
        if self.rank < self.size - 1:
            shape = (*inputs.shape[:2], self._hidden)
            h = mx.distributed.recv(shape, self._dtype, self.rank + 1, group=self._group)
        elif input_embeddings is not None:
            h = input_embeddings
        else:
            assert self.embed_tokens is not None
            h = self.embed_tokens(inputs)
        mask = create_attention_mask(h, cache[0])
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, mask, layer_cache)
        if self.rank == 0:
            return self.norm(h)
        h = mx.distributed.send(h, self.rank - 1, group=self._group)
        last = cache[-1]
        if last is not None:
            # Evaluating the cache alone (a chunk that does not end its prompt)
            # must still send this stage's output on.
            last.keys = mx.depends(last.keys, h)
        return h


def _untied(module: Any) -> bool:
    args = getattr(module, "args", None)
    return not getattr(args, "tie_word_embeddings", True) and hasattr(module, "lm_head")


@dataclass(frozen=True)
class Sharding:
    """Which mode, over which group; called by `load` on the lazily built module."""

    mode: str
    group: Any

    def batchable(self, model_type: str) -> bool:
        """Whether requests may decode as one batch. mlx-lm's deepseek_v41 pipeline
        stages read one position per forward (`cache[0].offset` as an int), which our
        batched V4.1 caches (each row at its own offset) do not have."""
        return not (self.mode == "pipeline" and model_type == "deepseek_v41")

    def __call__(self, module: Any, model_type: str) -> None:
        if self.mode not in MODES:
            raise ModelLoadError(f"--distributed must be one of {', '.join(MODES)}")
        refused = REFUSED.get((model_type, self.mode))
        if refused is not None:
            raise ModelLoadError(
                f"{model_type} cannot be served with --distributed {self.mode}: {refused}"
            )
        rank, size = int(self.group.rank()), int(self.group.size())
        own = model_type in OWN_PIPELINE
        # Untied plain-float embeddings and heads are split too (see the classes above):
        # with a 129k vocabulary they are most of a small model's weights.
        lean = own and _untied(module)
        if self.mode == "tensor":
            if not hasattr(module, "shard"):
                raise ModelLoadError(f"{model_type} has no tensor-parallel sharding")
            module.shard(self.group)
            if lean:
                module.lm_head = GatheredHead(module.lm_head, self.group)
                if type(module.model.embed_tokens) is nn.Embedding:
                    module.model.embed_tokens = GatheredEmbedding(
                        module.model.embed_tokens, self.group
                    )
        else:
            inner = getattr(module, "model", None)
            if own and inner is not None:
                module.model = PipelineStack(inner, self.group, lean)
                if lean and rank != 0:
                    module.lm_head = NullHead()
            elif inner is not None and hasattr(inner, "pipeline"):
                inner.pipeline(self.group)
            else:
                raise ModelLoadError(f"{model_type} has no pipeline-parallel stages")
        logger.info("rank %d of %d: %s-parallel shard of %s", rank, size, self.mode, model_type)
