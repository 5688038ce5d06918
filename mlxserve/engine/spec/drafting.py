"""Draft tokens for speculative decoding: what the scheduler proposes each step.

A `Drafter` proposes up to k tokens that may follow a request's context; the
runner verifies them in the step's decode forward (`verify.py`), and the
request keeps the longest prefix its sampler agrees with. `NgramDrafter` is
prompt lookup: the most recent earlier place where the context's last n
tokens occurred (n from `ngram_size` down to 2), and what followed there.
Coding agents re-emit what is already in their context (the file they edit,
the arguments of a repeated call), so those drafts are often right, with no
draft model and for every family.

`Speculator` holds each request's drafter state and its draft length, which
adapts to the request's acceptance: it starts at one token, all drafts
accepted grows it by one, a miss shrinks it to what was accepted, and a
request whose drafts keep missing drafts nothing for a while (doubling each
time), so a stream speculation cannot help pays for a probe now and then,
not every step. Rows of one
decode batch verify together and keep the same number of tokens (their
caches advance together), so a batch drafts only when every row has a
proposal, all of one length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mlxserve.engine.request import Request

# A request whose drafts missed this many verifies in a row pauses drafting.
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE_STEPS = 64
# Drafts start this short and grow by one per verify that keeps them all, so a
# request whose drafts miss pays for few extra positions.
FIRST_DRAFT_TOKENS = 1
# A single matching token is weak evidence: matches are at least this long.
MIN_NGRAM = 2


class Drafter(Protocol):
    """Proposes tokens that may follow a request's context."""

    name: str

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]: ...

    def forget(self, request_id: str) -> None: ...


class _NgramIndex:
    """Where each n-gram (n <= size) of a context last ended, grown as the context grows."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.indexed = 0  # n-grams ending before this position are indexed
        self.last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(size)]

    def extend(self, context: Sequence[int], upto: int) -> None:
        """Index the n-grams that end before `upto` (each maps to the position after it)."""
        for end in range(self.indexed, upto):
            for n in range(1, min(self.size, end + 1) + 1):
                self.last_end[n - 1][tuple(context[end + 1 - n : end + 1])] = end + 1
        self.indexed = max(self.indexed, upto)


class NgramDrafter:
    """Prompt lookup over the request's own prompt and output."""

    name = "ngram"

    def __init__(self, ngram_size: int) -> None:
        self.ngram_size = ngram_size
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        index = self._indexes.setdefault(request_id, _NgramIndex(self.ngram_size))
        # The last n-gram itself is not indexed yet: a match is an earlier occurrence.
        index.extend(context, len(context) - 1)
        shortest = min(MIN_NGRAM, self.ngram_size)
        for n in range(min(self.ngram_size, len(context)), shortest - 1, -1):
            follower = index.last_end[n - 1].get(tuple(context[-n:]))
            if follower is not None:
                return list(context[follower : follower + k])
        return []

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


@dataclass
class _Pace:
    """One request's draft length and back-off."""

    k: int
    misses: int = 0
    pause: int = 0  # steps left without drafts
    next_pause: int = 1


@dataclass
class SpeculationCounters:
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept
    forwards: int = 0  # rows verified (a batch of B rows verifying is B)


class Speculator:
    """Drafts for the scheduler's decode rows, with each request's adaptive draft length."""

    def __init__(self, drafter: Drafter, max_draft_tokens: int) -> None:
        self.drafter = drafter
        self.max_draft_tokens = max_draft_tokens
        self.counters = SpeculationCounters()
        self._paces: dict[str, _Pace] = {}
        # The most rows the runner verifies together (None: any).
        self.max_rows: int | None = None

    def plan(self, decodes: list[Request]) -> dict[str, list[int]]:
        """Drafts for every row, all of one length, or none at all."""
        paces = [
            self._paces.setdefault(
                r.request_id, _Pace(min(FIRST_DRAFT_TOKENS, self.max_draft_tokens))
            )
            for r in decodes
        ]
        paused = False
        for pace in paces:
            if pace.pause > 0:
                pace.pause -= 1
                paused = True
        if paused or not decodes:
            return {}
        if self.max_rows is not None and len(decodes) > self.max_rows:
            return {}
        proposals: dict[str, list[int]] = {}
        for request, pace in zip(decodes, paces, strict=True):
            # Never draft past max_tokens: the token after the drafts is sampled too.
            k = min(pace.k, request.params.max_tokens - len(request.output_ids) - 1)
            context = request.token_ids(request.prompt_ids) + request.output_ids
            drafts = self.drafter.propose(request.request_id, context, k) if k > 0 else []
            if not drafts:
                return {}
            proposals[request.request_id] = drafts
        length = min(len(d) for d in proposals.values())
        return {rid: drafts[:length] for rid, drafts in proposals.items()}

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verify of `proposed` drafts kept `accepted` of them."""
        c = self.counters
        c.proposed += proposed
        c.accepted += accepted
        c.forwards += 1
        pace = self._paces.get(request_id)
        if pace is None:
            return
        if accepted == proposed:
            pace.k = min(self.max_draft_tokens, pace.k + 1)
            pace.misses, pace.next_pause = 0, 1
            return
        pace.k = max(1, accepted + 1)
        pace.misses = pace.misses + 1 if accepted == 0 else 0
        if pace.misses >= MISSES_BEFORE_PAUSE:
            pace.pause, pace.misses = pace.next_pause, 0
            pace.next_pause = min(MAX_PAUSE_STEPS, pace.next_pause * 2)

    def forget(self, request_id: str) -> None:
        self._paces.pop(request_id, None)
        self.drafter.forget(request_id)

    def stats(self) -> dict[str, float | int | str]:
        c = self.counters
        return {
            "drafter": self.drafter.name,
            "draft_tokens": c.proposed,
            "accepted_tokens": c.accepted,
            "verify_forwards": c.forwards,
            # Tokens a row's verify forward produced: its accepted drafts and the one
            # it samples after them.
            "tokens_per_forward": (c.accepted + c.forwards) / c.forwards if c.forwards else 0.0,
        }


def make_speculator(mode: str, num_draft_tokens: int, ngram_size: int) -> Speculator | None:
    """The prompt-lookup speculator for `--speculative` (None when off).

    `mtp` drafts with the checkpoint's own head, which the engine loads with the
    model (`engine/core.py`); `auto` without such a head is prompt lookup."""
    if mode == "off":
        return None
    if mode == "mtp":
        raise ValueError("--speculative mtp drafts with the checkpoint's MTP head, not here")
    return Speculator(NgramDrafter(ngram_size), num_draft_tokens)
