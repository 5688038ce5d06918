"""How many prompt tokens one step prefills, and in which chunks.

The scheduler decides which requests prefill; this module sizes their chunks
within the step's `PrefillAllowance`: a token budget (the batch's, less one
token per decode row) and, while others decode or wait, the pacer's seconds
(`pacing.py`), so a step ends on time and decode stays alive (rule 5 of
docs/architecture.md). Each chunk is its own forward with a fixed cost of its
own: once one is planned, the next is planned only if it fits in the time left.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxserve.engine.pacing import FRESH_PROMPT_FACTOR, MIN_CHUNK_TOKENS, Pacer
from mlxserve.engine.plan import PrefillChunk
from mlxserve.engine.request import Request

# Before a forward's cost is measured, it is taken to cost this many prefill tokens.
UNMEASURED_FORWARD_TOKENS = 16


@dataclass
class PrefillAllowance:
    """What one step may still spend on prefill: tokens, and seconds where the pacer
    bounds the step (None: unpaced, only the token budget bounds it)."""

    tokens: int
    seconds: float | None


class PrefillSizer:
    def __init__(self, pacer: Pacer, min_chunk_tokens: int = MIN_CHUNK_TOKENS, num_layers: int = 1):
        self.pacer = pacer
        # Paced chunks are never cut shorter, so a long prompt always progresses
        # (and, where the model says short chunks cost more, never at a loss).
        self.min_chunk_tokens = max(MIN_CHUNK_TOKENS, min_chunk_tokens)
        # The shortest chunk this model can be fed at all (a hit's suffix ends in one).
        self.model_min_chunk = max(1, min_chunk_tokens)
        self.num_layers = max(1, num_layers)

    def allowance(
        self, tokens: int, decoding: int, prefilling: list[Request], alone: bool
    ) -> PrefillAllowance:
        """The step's allowance: `tokens`, and the pacer's seconds for `decoding` rows
        unless every prompt may be fed now (`feed_all_now`)."""
        seconds = self.pacer.prefill_budget_s(decoding, alone=alone)
        if seconds is not None and not decoding and self.feed_all_now(prefilling, tokens, seconds):
            seconds = None
        return PrefillAllowance(tokens, seconds)

    def feed_all_now(self, prefilling: list[Request], tokens: int, seconds: float) -> bool:
        """Nobody decoding and every prompt fits the budget: feed them all now when
        that ends on time (fresh prompts get a little longer), or when they are
        fresh prompts that arrived together (one grouped forward, see
        `prefill_group.py`). The tail of a long prompt stays paced: a request
        arriving now would wait for it."""
        whole = sum(r.prefill_remaining for r in prefilling)
        if whole > tokens:
            return False
        fresh = all(r.num_computed == 0 for r in prefilling)
        if len(prefilling) > 1 and fresh:
            return True
        return self.pacer.cost_s(whole) <= (seconds * FRESH_PROMPT_FACTOR if fresh else seconds)

    def chunk_tokens(
        self, request: Request, allowance: PrefillAllowance, planned: list[PrefillChunk]
    ) -> int:
        """Tokens of `request` to prefill in this step, after `planned` (0: none)."""
        seconds = allowance.seconds
        if seconds is None:
            return allowance.tokens
        remaining = request.prefill_remaining
        # A prompt that ends in this step sends its first token only when the step
        # ends: a chunk that does not also end a prompt waits a step.
        ends_a_prompt = bool(planned) and planned[-1].is_last
        if ends_a_prompt and (
            remaining > allowance.tokens or self.pacer.cost_s(remaining) > seconds
        ):
            return 0
        shortest = self.min_chunk_tokens
        fits = self.pacer.tokens_within(seconds)
        if planned and fits < min(shortest, remaining):
            return 0
        tokens = max(fits, shortest)
        if 0 < remaining - tokens < shortest:
            tokens = remaining  # leave no stub: it costs a forward
        return min(allowance.tokens, tokens)

    def spend(self, allowance: PrefillAllowance, tokens: int) -> None:
        allowance.tokens -= tokens
        if allowance.seconds is not None:
            allowance.seconds -= self.pacer.cost_s(tokens)

    def hit_suffix_tokens(self, request: Request, allowance: PrefillAllowance) -> int | None:
        """For a prefix-cache hit's suffix, prefilling alone, that pacing would cut
        into several chunks: the tokens of one chunk holding all of it but its last
        few (None otherwise).

        The suffix is this request's whole prefill (a turn's new messages), so each
        paced chunk's fixed cost lands on its own first token, and with nobody
        running there is no stream to pace for; the token budget still bounds the
        step a newcomer may wait for. A long prompt's tail stays paced. Where it
        pays (`tail_pays`: a shallow model) the prompt then ends in a chunk of the
        model's shortest length, as mlx-lm's own prefill does: a chunk that ends the
        prompt runs the last layer over all its positions, one that does not is
        evaluated only as far as the cache (`Runner._feed_only`). Never more
        forwards than pacing.
        """
        hit = request.cached_tokens
        if hit == 0 or request.num_computed != hit or request.fill_ids is not None:
            return None  # not a hit, or its first chunk has been fed
        remaining = request.prefill_remaining
        tail = self.model_min_chunk if self.tail_pays(remaining) else 0
        shortest = self.min_chunk_tokens
        if remaining > allowance.tokens or remaining - tail < shortest:
            return None
        if allowance.seconds is None:
            if tail == 0:
                return None  # unpaced, it goes in one chunk anyway
        elif max(self.pacer.tokens_within(allowance.seconds), shortest) > remaining - shortest:
            return None  # pacing feeds it in one chunk already
        return remaining - tail

    def tail_pays(self, suffix: int) -> bool:
        """Whether ending a hit's suffix in a short chunk of its own saves time.

        The chunk that ends a prompt runs its last layer over every position
        (the others stop at the cache), about 1/L of its work on an L-layer
        model; a separate short chunk costs one more forward, about a decode
        step. On a deep model (a real checkpoint on Metal) one chunk is cheaper;
        on a shallow one the split is. Unmeasured (a fresh engine), a forward is
        taken to cost as much as `UNMEASURED_FORWARD_TOKENS` prefill tokens.
        """
        step = self.pacer.decode_step_s(1)
        rate = self.pacer.prefill_rate_s()
        if step is None or rate is None:
            return suffix > self.num_layers * UNMEASURED_FORWARD_TOKENS
        return suffix * rate / self.num_layers > step
