"""Verifying draft tokens: which of a verify forward's positions each row keeps.

A verify forward feeds each row its last output token and its k drafts, and
gives logits at k + 1 positions. Position j is sampled exactly as a plain
decode step would sample it (the row's grammar mask, penalties, logit bias,
temperature and its random key, split once per position), so a row keeps
the tokens its own sampler draws and a draft only tells whether the next
position's input was right: while the drawn token equals the draft, the
following position was fed the right token and its draw stands too. Under
greedy this is exact match; under temperature it is the speculative
sampling rule for a drafter that proposes one token for sure (accepted with
probability p(draft), otherwise a draw from p without the draft), and with
a seed it draws the very tokens a plain run draws.

The rows of one batch advance their caches together, so they all keep the
same number of positions: the step stops at the first position where any
row's draw differs from its draft (that draw is kept: it is the token a
plain step would have produced there). Sampler state (grammar, penalties,
random keys) advances over kept tokens only.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from mlxserve.engine.request import Request
from mlxserve.engine.sampling import (
    SampledRow,
    SamplerState,
    record_token,
    sample_lazy,
    unconstrained_greedy,
)


def verify_rows(
    logits: mx.array,
    requests: list[Request],
    drafts: list[list[int]],
    states: list[SamplerState],
) -> list[list[SampledRow]]:
    """The tokens each row keeps from (B, k + 1, V) verify logits; all rows keep as many."""
    params = [r.params for r in requests]
    if all(unconstrained_greedy(p, s) for p, s in zip(params, states, strict=True)):
        return _greedy(logits, requests, drafts, states)
    kept: list[list[SampledRow]] = [[] for _ in requests]
    for position in range(logits.shape[1]):
        if any(s.constrained for s in states):
            mx.async_eval(logits)  # the forward runs while the grammar masks are filled
        drawn = sample_lazy(logits[:, position, :], params, states).take()
        for request, state, row, out in zip(requests, states, drawn, kept, strict=True):
            record_token(state, request.params, row.token)
            out.append(row)
        if position == len(drafts[0]):
            break
        if any(row.token != d[position] for row, d in zip(drawn, drafts, strict=True)):
            break
    return kept


def _greedy(
    logits: mx.array, requests: list[Request], drafts: list[list[int]], states: list[SamplerState]
) -> list[list[SampledRow]]:
    """Every position's argmax in one evaluation; rows keep up to the first miss of any row."""
    targets = cast(list[list[int]], mx.argmax(logits, axis=-1).tolist())
    keep = len(drafts[0]) + 1
    for row_targets, row_drafts in zip(targets, drafts, strict=True):
        for position, draft in enumerate(row_drafts):
            if row_targets[position] != draft:
                keep = min(keep, position + 1)
                break
    kept = []
    for request, state, row_targets in zip(requests, states, targets, strict=True):
        rows = [SampledRow(token, None, None) for token in row_targets[:keep]]
        for row in rows:
            record_token(state, request.params, row.token)
        kept.append(rows)
    return kept
