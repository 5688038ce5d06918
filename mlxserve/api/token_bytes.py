"""Each token's own UTF-8 bytes, for the `bytes` of a log-probability.

OpenAI's contract: a token's `bytes` are the bytes it stands for, which may be
part of a character (byte-level BPE splits a CJK character or an emoji across
tokens), so that the bytes of consecutive tokens join to the text. The
token's text (`decode([id])`) cannot give them: a partial character decodes
to U+FFFD. So the bytes come from the token's vocabulary spelling instead:

* byte-level BPE (GPT-2's alphabet, `Ġ` for a space; DeepSeek-V4, Qwen,
  Llama 3): each character of the spelling stands for one byte;
* SentencePiece with byte fallback: `<0xAB>` is that one byte, `▁` a space;
* anything else, and added or special tokens (whose spelling is their text):
  the UTF-8 of `decode([id])`.

The answer per id is kept (at most one entry per vocabulary id), so a token
costs a dict look-up once seen.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Callable
from typing import Any

SPM_SPACE = "\u2581"  # "▁"
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# A tokenizer's spelling rule: the bytes of a vocabulary spelling, or None where
# the rule does not cover it (then the token's decoded text is used).
Speller = Callable[[str], bytes | None]


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: character -> the byte it stands for."""
    # Imported here: transformers is slow to import and only a real tokenizer needs it.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def byte_level_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level BPE spelling stands for (None: not in its alphabet)."""
    table = _byte_of_char()
    try:
        return bytes(table[char] for char in piece)
    except KeyError:
        return None


def sentencepiece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece spelling stands for: `<0xAB>` one byte, `▁` a space."""
    match = _SPM_BYTE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(SPM_SPACE, " ").encode("utf-8")


def _decoder_types(decoder: Any) -> set[str]:
    """The `type` of a tokenizers decoder and of every decoder in a Sequence."""
    if isinstance(decoder, dict):
        found = {str(decoder.get("type"))}
        for inner in decoder.get("decoders") or ():
            found |= _decoder_types(inner)
        return found
    return set()


def speller_for(tokenizer: Any) -> Speller | None:
    """The spelling rule of `tokenizer`'s vocabulary, or None when it is neither kind.

    `tokenizer` is a Hugging Face tokenizer or mlx-lm's TokenizerWrapper, which
    hands the public attributes read here on to the one it wraps.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        # A tokenizers decoder pickles as its JSON: the one place its kind is public.
        types = _decoder_types(json.loads(decoder.__getstate__()))
        if "ByteLevel" in types:
            return byte_level_bytes
        if "ByteFallback" in types or "Metaspace" in types:
            return sentencepiece_bytes
        return None
    if getattr(tokenizer, "sp_model", None) is not None:  # a slow (Python) SentencePiece tokenizer
        return sentencepiece_bytes
    if getattr(tokenizer, "byte_encoder", None) is not None:  # a slow GPT-2 style tokenizer
        return byte_level_bytes
    return None


class TokenBytes:
    """`token_bytes(id) -> bytes`: the token's own UTF-8 bytes, kept per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._speller = speller_for(tokenizer)
        # Added and special tokens are spelled as their text, not in the byte alphabet.
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = frozenset(int(i) for i in added)
        self._known: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        known = self._known.get(token)
        if known is None:
            known = self._known[token] = self._spell(token)
        return known

    def _spell(self, token: int) -> bytes:
        if self._speller is not None and token not in self._added:
            piece = self._tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str):
                spelled = self._speller(piece)
                if spelled is not None:
                    return spelled
        return str(self._tokenizer.decode([token])).encode("utf-8")


# One TokenBytes per tokenizer, shared by its requests, gone with the tokenizer.
_PER_TOKENIZER: weakref.WeakKeyDictionary[Any, TokenBytes] = weakref.WeakKeyDictionary()


def token_bytes_for(tokenizer: Any) -> TokenBytes:
    """The shared TokenBytes of `tokenizer` (a fresh one if it cannot be weakly keyed)."""
    try:
        found = _PER_TOKENIZER.get(tokenizer)
    except TypeError:  # an object that takes no weak reference or no hash
        return TokenBytes(tokenizer)
    if found is None:
        found = _PER_TOKENIZER[tokenizer] = TokenBytes(tokenizer)
    return found
