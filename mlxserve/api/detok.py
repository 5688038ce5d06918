"""Incremental detokenization that keeps every byte the model produced.

mlx-lm's `BPEStreamingDetokenizer` drops a leading space from the first
segment of a stream (" Paris" -> "Paris"), which breaks text completions
and the rule that the client's bytes are the model's bytes. This decoder
instead diffs two `tokenizer.decode` calls over a short sliding window
(the approach vLLM uses): the text of window+new token minus the text of
the window. A few prompt tokens seed the window, so tokenizers that strip a
leading space at sequence start (SentencePiece) still get it right. Text
ending in an incomplete UTF-8 sequence (U+FFFD) is held until it completes.
Work per token is proportional to the window, not to the text so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 4
REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """`add(token) -> new text` per token, `flush()` at the end."""

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids = [int(t) for t in context[-CONTEXT_TOKENS:]] if context else []
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def add(self, token: int) -> str:
        self._ids.append(int(token))
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self._advance()
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._advance()
        return after[len(before) :] if len(after) > len(before) else ""

    def _advance(self) -> None:
        self._prefix = self._read
        self._read = len(self._ids)
        if self._prefix:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
