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

A step's masks are computed together, when its draw is built (`batch_masks`):
one llguidance call fills every constrained row's bitmask on its own thread
pool, without the GIL, while the step's forward runs. (A worker thread per
mask, as before, paid a GIL hand-over per mask, serially: up to a switch
interval each while the owner thread built graphs, which a batch of eight
felt.)
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxserve.engine.request import Constraint

logger = logging.getLogger(__name__)


class ConstraintError(RuntimeError):
    """The grammar rejected a token or could not be built (fails the request)."""


class GrammarTokenizer:
    """llguidance's tokenizer for one model (built by `prepare`, or on first use)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_id: int) -> None:
        self._path = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._build: Future[Any] | None = None
        self._executor: Any = None

    def prepare(self) -> None:
        """Start building it on a thread of its own (once; `get` waits for it)."""
        if self._build is None:
            self._build = _shared_build(self._path, self.vocab_size, self.eos_token_id)

    def executor(self) -> Any:
        """llguidance's thread pool for filling a batch's masks (one per model's engine)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

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

        self._start_after = frozenset(constraint.start_after)
        self.active = not self._start_after
        self.tokenizer = tokenizer
        self.matcher = llguidance.LLMatcher(tokenizer.get(), constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar failed: {self.matcher.get_error()}")

    def allowed(self, vocab_size: int) -> mx.array:
        """A (vocab_size,) bool mask of the tokens the grammar allows next."""
        return batch_masks([self], vocab_size)[0]

    def advance(self, token: int) -> None:
        """Record the sampled token (it switches the grammar on when it ends reasoning)."""
        if not self.active:
            self.active = token in self._start_after
            return
        if self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"the grammar rejected token {token}: {self.matcher.get_error()}")


def batch_masks(states: list[ConstraintState], vocab_size: int) -> mx.array:
    """(len(states), vocab_size) bool: the tokens each grammar allows next, filled in one
    call; tokens past the grammar's vocabulary (padding rows of the head) are never allowed."""
    from llguidance.numpy import (
        allocate_token_bitmask,
        fill_next_token_bitmask,
        fill_next_token_bitmask_par,
    )

    vocab = states[0].tokenizer.vocab_size
    bitmask = allocate_token_bitmask(len(states), vocab)
    if len(states) == 1:
        fill_next_token_bitmask(states[0].matcher, bitmask)
    else:
        rows = [(state.matcher, index) for index, state in enumerate(states)]
        fill_next_token_bitmask_par(states[0].tokenizer.executor(), rows, bitmask)
    # Unpacked on the host in one small numpy pass (llguidance packs little-endian
    # int32 words); mlx would take three elementwise passes over every bit.
    vocab_bits = min(vocab, vocab_size)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_bits, bitorder="little")
    if vocab_bits < vocab_size:
        bits = np.pad(bits, ((0, 0), (0, vocab_size - vocab_bits)))
    return mx.array(bits.view(np.bool_))
