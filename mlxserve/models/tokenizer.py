"""A checkpoint's tokenizer, read once per process for the same tokenizer files."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any


def load_tokenizer(path: Path, eos_token_id: Any = None) -> Any:
    """mlx-lm's TokenizerWrapper (HF tokenizer + streaming detokenizer).

    A tokenizer read before in this process from the same files (an engine
    restarted, one checkpoint served under two names, a copy of a checkpoint in
    another folder) is reused: reading a large vocabulary takes most of a small
    model's load (about a second for DeepSeek's 129k entries). Sharing is safe: the
    wrapper hands each caller a detokenizer of its own and encoding keeps no state."""
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


# Tokenizers read in this process, by `_tokenizer_key`; a few (each holds a vocabulary,
# 60-100 MB for DeepSeek's): what a server of several models holds anyway.
_TOKENIZERS: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_TOKENIZERS_LOCK = threading.Lock()
_TOKENIZERS_KEPT = 8

# Files a tokenizer is never read from: weights, by their suffix or their size (the
# largest tokenizer files are tens of MB).
_WEIGHT_SUFFIXES = frozenset(
    (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npz", ".npy", ".h5", ".ckpt", ".onnx")
)
_LARGEST_TOKENIZER_FILE = 256 << 20


def _tokenizer_key(path: Path, eos_token_id: Any) -> tuple[Any, ...] | None:
    """What the tokenizer is read from: the contents of every file in the folder but the
    weights (config.json included: transformers reads the model type there), and the
    end-of-sequence ids given. None where the folder cannot be read."""
    digest = hashlib.sha256()
    try:
        for file in sorted(path.iterdir()):
            if not file.is_file() or file.suffix in _WEIGHT_SUFFIXES:
                continue
            if file.stat().st_size > _LARGEST_TOKENIZER_FILE:
                continue
            digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
            digest.update(file.read_bytes())
    except OSError:
        return None
    return (digest.hexdigest(), repr(eos_token_id))
