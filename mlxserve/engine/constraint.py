"""Constrained decoding on the owner thread: one llguidance matcher per request.

`GrammarTokenizer` builds llguidance's view of the model's vocabulary once
(about a second for DeepSeek-V4's 129k tokens, so only when the first
constrained request arrives). `ConstraintState` follows one request: until a
`start_after` token is sampled it lets everything through; then each step it
gives the mask of allowed next tokens and consumes the sampled one. When the
grammar is complete the mask allows only end-of-sequence, so the request
stops with complete output. Rows without a constraint never touch any of this.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxserve.engine.request import Constraint

logger = logging.getLogger(__name__)


class ConstraintError(RuntimeError):
    """The grammar rejected a token or could not be built (fails the request)."""


class GrammarTokenizer:
    """llguidance's tokenizer for one model (built on first use)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_id: int) -> None:
        self._path = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer: Any = None

    def get(self) -> Any:
        if self._tokenizer is None:
            import llguidance

            if not self._path.is_file():
                raise ConstraintError(
                    f"structured output needs {self._path.name} next to the model"
                )
            self._tokenizer = llguidance.LLTokenizer(
                self._path.read_text(encoding="utf-8"),
                n_vocab=self.vocab_size,
                eos_token=self.eos_token_id,
            )
            logger.info("built the grammar tokenizer (%d tokens)", self.vocab_size)
        return self._tokenizer


class ConstraintState:
    """One request's matcher and whether its grammar applies yet."""

    def __init__(self, constraint: Constraint, tokenizer: GrammarTokenizer) -> None:
        import llguidance

        self._start_after = frozenset(constraint.start_after)
        self.active = not self._start_after
        self._vocab = tokenizer.vocab_size
        self._matcher = llguidance.LLMatcher(tokenizer.get(), constraint.grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"the grammar failed: {self._matcher.get_error()}")

    def allowed(self, vocab_size: int) -> mx.array:
        """A (vocab_size,) bool mask of the tokens the grammar allows next."""
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: min(self._vocab, vocab_size)]
        if len(bits) < vocab_size:
            bits = np.concatenate([bits, np.zeros(vocab_size - len(bits), dtype=np.uint8)])
        return mx.array(bits.astype(np.bool_))

    def advance(self, token: int) -> None:
        """Record the sampled token (it switches the grammar on when it ends reasoning)."""
        if not self.active:
            self.active = token in self._start_after
            return
        if self._matcher.is_stopped():
            return
        if not self._matcher.consume_token(token):
            raise ConstraintError(
                f"the grammar rejected token {token}: {self._matcher.get_error()}"
            )
