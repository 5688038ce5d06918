"""Drafts from DeepSeek-V4's own MTP head (`models/mtp.py`), behind the `Drafter` interface.

MTP position i reads the main model's hidden state at position i and the
token at i + 1; its logits guess token i + 2. The runner hands every hidden
state a forward computes for a kept position to `observe` (prefill chunks,
decode steps, a verify's kept positions: never a rejected draft's), and
`propose` catches the head's cache up to the context's end, takes its guess
for the token after the context, then chains: each guess and the head's own
output state feed the next position, for up to k tokens. The chained
positions are drafts, not the main model's states, so the head's cache is
put back as it was before them (mlx-vlm's cache transaction, aborted).

The head attends over a sliding window, so positions more than a window
before the context's end are never read again: `observe` keeps at most a
window of states it has not fed, and a gap (a prefix-cache hit, whose states
were never computed here, or a batch that did not draft for a long time)
starts the head's cache afresh at the window's start. Its drafts only
decide how many tokens a verify forward checks; the verify decides the
tokens (rule 11 of docs/architecture.md), so a draft made over a short history is still exact.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_vlm.speculative.cache_state import start_speculative_cache

from mlxserve.engine.request import Request
from mlxserve.models.deepseek_v4.mtp import MtpHead
from mlxserve.models.loaded import LoadedModel

logger = logging.getLogger(__name__)


@dataclass
class _HeadState:
    """One request's MTP cache, and main-model states for positions not fed to it yet."""

    cache: list[Any]
    fed: int  # MTP positions before this are in `cache` (or out of its window)
    known: int  # main-model states are known for positions before this
    pending: list[mx.array] = field(default_factory=list)  # (L, hc, D) blocks for fed..known
    # The head's guess and state after its last fed position, for a repeated proposal.
    tail: tuple[int, mx.array, mx.array] | None = None

    def states(self, count: int) -> mx.array:
        """The pending states of the next `count` positions, (1, count, hc, D)."""
        joined = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending)
        self.pending = [joined[count:]] if count < joined.shape[0] else []
        return joined[None, :count]


class MtpDrafter:
    """Proposes the MTP head's greedy guesses for the tokens after a request's context."""

    name = "mtp"

    def __init__(self, head: MtpHead) -> None:
        self.head = head
        self._states: dict[str, _HeadState] = {}

    def observe(self, request_id: str, start: int, hidden: mx.array) -> None:
        """Main-model states (L, hc, D) of positions `start ..` of a request's context."""
        state = self._states.get(request_id)
        if state is None or start > state.known:
            state = _HeadState(self.head.make_cache(), fed=start, known=start)
            self._states[request_id] = state
        # A request's tokens do not change, so neither do their states: only new
        # positions are kept. (A run-ahead step dropped by a preemption may leave a
        # state whose token is drawn again: only a draft's quality could suffer.)
        new = hidden[state.known - start :]
        if new.shape[0] == 0:
            return
        window = self.head.window
        if new.shape[0] > window:  # a long prefill chunk: only its last window is read
            state.cache, state.pending, state.tail = self.head.make_cache(), [], None
            state.fed = start + hidden.shape[0] - window
            new = new[-window:]
        # A copy, so the slice does not hold a whole prefill's (or batch's) states,
        # made as soon as the forward has computed them.
        copy = mx.array(new)
        mx.async_eval(copy)
        state.pending.append(copy)
        state.known = start + hidden.shape[0]
        if state.known - state.fed > 2 * window or len(state.pending) > window:
            self._compact(state, state.known)

    def _compact(self, state: _HeadState, upto: int) -> None:
        """Keep the unfed states from a window before `upto` on: positions before that
        are never attended again, so the head's cache starts afresh there."""
        window = self.head.window
        joined = mx.concatenate(state.pending)
        if upto - state.fed > window:
            state.cache = self.head.make_cache()
            state.fed, state.tail = upto - window, None
        state.pending = [mx.array(joined[-(state.known - state.fed) :])]
        # Evaluated as soon as the forward that computes them is: otherwise a row
        # that never drafts would keep a growing graph of every step's states.
        mx.async_eval(state.pending)

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        try:
            return self._propose(request_id, context, k)
        except (RuntimeError, ValueError):
            # Drafts never decide the output: a head that fails drafts nothing for
            # this request (its state starts afresh), and the request decodes on.
            logger.exception("MTP drafting failed for request %s", request_id)
            self.forget(request_id)
            return []

    def _propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        state = self._states.get(request_id)
        end = len(context) - 1  # the last token has no main-model state yet
        if state is None or k <= 0 or end < 1 or state.known < end or state.fed > end:
            return []
        if state.fed < end:
            if end - state.fed > self.head.window:
                self._compact(state, end)
            start = state.fed
            states = state.states(end - start)
            tokens = mx.array([list(context[start + 1 : end + 1])], dtype=mx.int32)
            logits, out = self.head.forward(tokens, states, state.cache, start)
            state.fed, state.tail = end, (end - 1, mx.argmax(logits, axis=-1), out[:, -1:])
        if state.tail is None or state.tail[0] != end - 1:
            return []
        _, guess, out = state.tail
        return self._chain(state, guess, out, end, k)

    def _chain(
        self, state: _HeadState, guess: mx.array, out: mx.array, end: int, k: int
    ) -> list[int]:
        """Up to k guesses: each feeds the next position with the head's own state."""
        guesses = [guess]
        if k > 1:
            transaction = start_speculative_cache(state.cache, k - 1)
            try:
                for step in range(k - 1):
                    tokens = guesses[-1].astype(mx.int32)[:, None]
                    logits, out = self.head.forward(tokens, out, state.cache, end + step)
                    guesses.append(mx.argmax(logits, axis=-1))
                drafts = cast(list[int], mx.concatenate(guesses).tolist())
            finally:
                transaction.abort()
            return drafts
        return cast(list[int], guesses[0].tolist())

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)


class HiddenTap:
    """The runner's model forwards; with `drafter` set, the hidden states of the
    positions each one keeps go to the MTP drafter (row b of a forward: request
    rows[b][0], positions from rows[b][1] on)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded  # its `model` is read at each call: tests may wrap it
        self.drafter: MtpDrafter | None = None

    def last_logits(
        self,
        inputs: mx.array,
        cache: list[Any],
        rows: list[tuple[str, int]],
        embeddings: mx.array | None = None,
    ) -> mx.array:
        """(B, V) logits of each row's last position; every fed position is kept.
        `embeddings` (a prompt with images): the inputs' embeddings, fed instead."""
        model = self.loaded.model
        if embeddings is not None:
            if self.drafter is not None:
                raise ValueError("speculative decoding with an MTP head takes no images")
            return cast(mx.array, model.last_logits(inputs, cache, embeddings=embeddings))
        if self.drafter is None:
            return cast(mx.array, model.last_logits(inputs, cache))
        sink: list[mx.array] = []
        logits = model.last_logits(inputs, cache, sink)
        self.keep(sink, rows)
        return cast(mx.array, logits)

    def logits(self, inputs: mx.array, cache: list[Any]) -> tuple[mx.array, list[mx.array]]:
        """(B, L, V) logits and the states to `keep` once the kept positions are known."""
        model = self.loaded.model
        if self.drafter is None:
            return model(inputs, cache), []
        sink: list[mx.array] = []
        return model(inputs, cache, sink), sink

    def keep(
        self, sink: list[mx.array], rows: list[tuple[str, int]], count: int | None = None
    ) -> None:
        """Hand the drafter the first `count` (default: all) positions' states of each row."""
        if self.drafter is None or not sink:
            return
        for row, (request_id, start) in enumerate(rows):
            self.drafter.observe(request_id, start, sink[0][row, :count])


def decode_positions(requests: Sequence[Request], ahead: int = 0) -> list[tuple[str, int]]:
    """Each decode row's request and the position of the token it feeds: its last, or
    (`ahead` = 1) the one being drawn, which a run-ahead step feeds."""
    return [(r.request_id, r.num_prompt + len(r.output_ids) - 1 + ahead) for r in requests]
