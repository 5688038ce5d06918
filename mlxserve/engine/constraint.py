"""Constrained decoding on the owner thread: one llguidance matcher per request.

`GrammarTokenizer` builds llguidance's view of the model's vocabulary once
(about a second for DeepSeek-V4's 129k tokens, holding the GIL most of that
time). The engine starts the build as the model loads (`prepare`), beside its
memory probe, so no step and no request waits for it; engines of one process
whose tokenizer files hold the same bytes share one build.

`ConstraintState` follows one request: until a `start_after` token is sampled
it lets everything through; then each step it gives the mask of allowed next
tokens and consumes the sampled one. When the grammar is complete the mask
allows only end-of-sequence, so the request stops with complete output. Rows
without a constraint never touch any of this.

The next mask is computed on a worker thread as soon as a token is consumed
(llguidance drops the GIL while it computes), so it is ready by the time the
next forward's logits are: the decode step does not wait on the grammar.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxserve.engine.request import Constraint

logger = logging.getLogger(__name__)

# Masks are computed here, off the owner thread; one at a time keeps a step's
# mask work on one core beside the forward.
_MASK_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxserve-grammar")


class ConstraintError(RuntimeError):
    """The grammar rejected a token or could not be built (fails the request)."""


class GrammarTokenizer:
    """llguidance's tokenizer for one model (built by `prepare`, or on first use)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_id: int) -> None:
        self._path = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._build: Future[Any] | None = None

    def prepare(self) -> None:
        """Start building it on a thread of its own (once; `get` waits for it)."""
        if self._build is None:
            self._build = _shared_build(self._path, self.vocab_size, self.eos_token_id)

    def get(self) -> Any:
        """The tokenizer; ConstraintError if it cannot be built."""
        self.prepare()
        assert self._build is not None
        return self._build.result()


# Builds by (tokenizer file digest, vocabulary size, end token): one per distinct tokenizer.
_BUILDS: dict[tuple[str, int, int], Future[Any]] = {}
_BUILDS_LOCK = threading.Lock()


def _shared_build(path: Path, vocab_size: int, eos_token_id: int) -> Future[Any]:
    """This tokenizer's build: the one under way or done, or a new one on its own thread."""
    build: Future[Any] = Future()
    try:
        text = path.read_bytes()
    except OSError:
        build.set_exception(
            ConstraintError(f"structured output needs {path.name} next to the model")
        )
        return build
    key = (hashlib.sha256(text).hexdigest(), vocab_size, eos_token_id)
    with _BUILDS_LOCK:
        if key in _BUILDS:
            return _BUILDS[key]
        _BUILDS[key] = build

    def run() -> None:
        import llguidance

        try:
            tokenizer = llguidance.LLTokenizer(
                text.decode("utf-8"), n_vocab=vocab_size, eos_token=eos_token_id
            )
            logger.info("built the grammar tokenizer (%d tokens)", vocab_size)
            build.set_result(tokenizer)
        except (ValueError, RuntimeError, UnicodeDecodeError) as e:
            error = ConstraintError(f"the grammar tokenizer could not be built: {e}")
            error.__cause__ = e
            build.set_exception(error)
        finally:
            if not build.done():  # anything else still resolves it (get() never hangs)
                build.set_exception(ConstraintError("building the grammar tokenizer failed"))

    threading.Thread(target=run, name="mlxserve-grammar-tokenizer", daemon=True).start()
    return build


class ConstraintState:
    """One request's matcher and whether its grammar applies yet."""

    def __init__(self, constraint: Constraint, tokenizer: GrammarTokenizer) -> None:
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        self._start_after = frozenset(constraint.start_after)
        self.active = not self._start_after
        self._vocab = tokenizer.vocab_size
        self._matcher = llguidance.LLMatcher(tokenizer.get(), constraint.grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"the grammar failed: {self._matcher.get_error()}")
        self._mask = allocate_token_bitmask(1, self._vocab)
        self._fill = fill_next_token_bitmask
        self._next: Future[None] | None = None
        if self.active:
            self._prepare()

    def _prepare(self) -> None:
        """Start computing the mask for the next token (the matcher is not touched until done)."""
        self._next = _MASK_WORKER.submit(self._fill, self._matcher, self._mask)

    def _wait(self) -> None:
        if self._next is not None:
            next_mask, self._next = self._next, None
            next_mask.result()

    def allowed(self, vocab_size: int) -> mx.array:
        """A (vocab_size,) bool mask of the tokens the grammar allows next."""
        if self._next is None:
            self._prepare()
        self._wait()
        words = self._mask.view(np.uint8)[0]
        bits = np.unpackbits(words, bitorder="little")[: min(self._vocab, vocab_size)]
        if len(bits) < vocab_size:
            bits = np.concatenate([bits, np.zeros(vocab_size - len(bits), dtype=np.uint8)])
        return mx.array(bits.astype(np.bool_))

    def advance(self, token: int) -> None:
        """Record the sampled token (it switches the grammar on when it ends reasoning)."""
        if not self.active:
            self.active = token in self._start_after
            if self.active:
                self._prepare()
            return
        self._wait()
        if self._matcher.is_stopped():
            return
        if not self._matcher.consume_token(token):
            raise ConstraintError(
                f"the grammar rejected token {token}: {self._matcher.get_error()}"
            )
        self._prepare()
