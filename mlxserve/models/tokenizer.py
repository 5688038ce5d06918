"""A checkpoint's tokenizer, read once per process while its files are unchanged."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from mlxserve.models.loaded import directory_signature


def load_tokenizer(path: Path, eos_token_id: Any = None) -> Any:
    """mlx-lm's TokenizerWrapper (HF tokenizer + streaming detokenizer).

    A directory loaded again in this process (an engine restarted, one checkpoint
    served under two names) reuses the wrapper read before, while the directory's
    files are unchanged: reading a large vocabulary takes most of a small model's
    load. Sharing is safe: the wrapper hands each caller a detokenizer of its own
    and encoding keeps no state."""
    from mlx_lm.tokenizer_utils import load as load_wrapper

    key = _tokenizer_key(Path(path), eos_token_id)
    with _TOKENIZERS_LOCK:
        if key is not None and key in _TOKENIZERS:
            _TOKENIZERS.move_to_end(key)
            return _TOKENIZERS[key]
    tokenizer = load_wrapper(Path(path), eos_token_ids=eos_token_id)
    if key is not None:
        with _TOKENIZERS_LOCK:
            _TOKENIZERS[key] = tokenizer
            while len(_TOKENIZERS) > _TOKENIZERS_KEPT:
                _TOKENIZERS.popitem(last=False)
    return tokenizer


# Tokenizers read in this process, by `_tokenizer_key`; a few (each holds a vocabulary).
_TOKENIZERS: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_TOKENIZERS_LOCK = threading.Lock()
_TOKENIZERS_KEPT = 4


def _tokenizer_key(path: Path, eos_token_id: Any) -> tuple[Any, ...] | None:
    signature = directory_signature(path)
    return None if signature is None else (*signature, repr(eos_token_id))
