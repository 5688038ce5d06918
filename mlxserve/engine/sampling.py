"""Per-request logits processing and sampling, one row of a batch at a time.

Each request owns its random key (seeded or drawn at admission) and splits it
once per step, so a seeded request draws the same tokens alone or in a batch.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlxserve.engine.constraint import ConstraintState, GrammarTokenizer, batch_masks
from mlxserve.engine.request import SEED_LIMIT, SamplingParams


def int_list(array: mx.array) -> list[int]:
    """A 1-D integer array as Python ints (mlx's stubs type tolist() loosely)."""
    return cast(list[int], array.tolist())


@dataclass
class SamplerState:
    """What sampling needs to remember between the steps of one request."""

    key: mx.array
    output_counts: Counter[int] = field(default_factory=Counter)
    seen: set[int] = field(default_factory=set)
    seen_array: mx.array | None = None
    seen_dirty: bool = True
    bias_ids: mx.array | None = None
    bias_values: mx.array | None = None
    constraint: ConstraintState | None = None

    @property
    def constrained(self) -> bool:
        """Whether a grammar masks this row's next token."""
        return self.constraint is not None and self.constraint.active


def new_sampler_state(
    params: SamplingParams, prompt_ids: list[int], grammar: GrammarTokenizer | None = None
) -> SamplerState:
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    state = SamplerState(key=mx.random.key(seed % SEED_LIMIT))
    if params.constraint is not None:
        if grammar is None:
            raise ValueError("this model cannot take structured-output constraints")
        state.constraint = ConstraintState(params.constraint, grammar)
    if params.repetition_penalty != 1.0:
        state.seen.update(prompt_ids)
    if params.logit_bias:
        state.bias_ids = mx.array([token for token, _ in params.logit_bias], dtype=mx.int32)
        state.bias_values = mx.array([value for _, value in params.logit_bias], dtype=mx.float32)
    return state


def record_token(state: SamplerState, params: SamplingParams, token: int) -> None:
    if state.constraint is not None:
        state.constraint.advance(token)
    if params.presence_penalty or params.frequency_penalty:
        state.output_counts[token] += 1
    if params.repetition_penalty != 1.0 and token not in state.seen:
        state.seen.add(token)
        state.seen_dirty = True


def _process(row: mx.array, params: SamplingParams, state: SamplerState) -> mx.array:
    """Penalties and logit bias on one (1, V) row of logits (a grammar row arrives
    already masked by `_masked_rows`)."""
    row = row.astype(mx.float32)
    if params.repetition_penalty != 1.0 and state.seen:
        if state.seen_dirty or state.seen_array is None:
            state.seen_array = mx.array(sorted(state.seen), dtype=mx.int32)
            state.seen_dirty = False
        picked = row[:, state.seen_array]
        penalty = params.repetition_penalty
        row[:, state.seen_array] = mx.where(picked > 0, picked / penalty, picked * penalty)
    if state.output_counts and (params.presence_penalty or params.frequency_penalty):
        ids = mx.array(list(state.output_counts), dtype=mx.int32)
        counts = mx.array(list(state.output_counts.values()), dtype=mx.float32)
        row[:, ids] = row[:, ids] - (params.presence_penalty + params.frequency_penalty * counts)
    if state.bias_ids is not None and state.bias_values is not None:
        row[:, state.bias_ids] = row[:, state.bias_ids] + state.bias_values
    return row


def _draw(logprobs: mx.array, params: SamplingParams, state: SamplerState) -> mx.array:
    scaled = logprobs * (1.0 / params.temperature)
    if 0 < params.top_k < scaled.shape[-1]:  # a top_k past the vocabulary keeps every token
        scaled = apply_top_k(scaled, params.top_k)
    if params.min_p > 0:
        scaled = apply_min_p(scaled, params.min_p)
    if params.top_p < 1.0:
        scaled = apply_top_p(scaled, params.top_p)
    state.key, sub = mx.random.split(state.key)
    return mx.random.categorical(scaled, key=sub)


@dataclass(frozen=True)
class SampledRow:
    token: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None


def _plain_greedy(params: SamplingParams) -> bool:
    return (
        params.greedy and not params.needs_history and not params.logit_bias and not params.logprobs
    )


def unconstrained_greedy(params: SamplingParams, state: SamplerState) -> bool:
    """Whether this row's token is the plain argmax of its logits (nothing else to apply)."""
    return _plain_greedy(params) and not state.constrained


def pipelinable(params: SamplingParams, state: SamplerState) -> bool:
    """Whether this row's next token can be drawn before its current one is read:
    nothing it samples with depends on the host knowing the tokens so far. A row
    with a grammar, even one that starts only after reasoning ends, needs them."""
    return state.constraint is None and not params.needs_history


@dataclass
class PendingLogits:
    """A decode step's forward, started before the tokens it is fed were read; its own
    tokens are drawn only once they are (`sample_lazy` then), for rows whose sampling
    needs them: a grammar's next mask, penalties over the output so far."""

    logits: mx.array

    def start(self) -> None:
        mx.async_eval(self.logits)

    def rows(self, keep: list[int]) -> PendingLogits:
        return PendingLogits(self.logits[mx.array(keep, dtype=mx.int32)])


@dataclass
class PendingSample:
    """One token per row, drawn lazily: `start()` schedules it, `take()` reads it."""

    tokens: mx.array
    logprob_rows: list[mx.array | None]
    params: list[SamplingParams]

    def _arrays(self) -> list[mx.array]:
        return [self.tokens, *[r for r in self.logprob_rows if r is not None]]

    def start(self) -> None:
        mx.async_eval(self._arrays())

    def rows(self, keep: list[int]) -> PendingSample:
        """The same draw for the rows at `keep` only."""
        return PendingSample(
            self.tokens[mx.array(keep, dtype=mx.int32)],
            [self.logprob_rows[i] for i in keep],
            [self.params[i] for i in keep],
        )

    def take(self) -> list[SampledRow]:
        mx.eval(self._arrays())
        return [
            _with_logprobs(token_id, params, row_logprobs)
            for token_id, params, row_logprobs in zip(
                int_list(self.tokens), self.params, self.logprob_rows, strict=True
            )
        ]


def sample_lazy(
    logits: mx.array, params_list: list[SamplingParams], states: list[SamplerState]
) -> PendingSample:
    """The graph that picks one token per row of (B, V) logits, not yet evaluated.

    A row's random key is split here, so a row draws the same tokens whenever
    its draw is evaluated.
    """
    if all(unconstrained_greedy(p, s) for p, s in zip(params_list, states, strict=True)):
        return PendingSample(mx.argmax(logits, axis=-1), [None] * len(params_list), params_list)
    picked: list[mx.array] = []
    logprob_rows: list[mx.array | None] = []
    masked = _masked_rows(logits, states)
    for index, (params, state) in enumerate(zip(params_list, states, strict=True)):
        row = masked.get(index, logits[index : index + 1])
        row = _process(row, params, state)
        logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
        token = mx.argmax(logprobs, axis=-1) if params.greedy else _draw(logprobs, params, state)
        picked.append(token.reshape(1))
        logprob_rows.append(logprobs[0] if params.logprobs else None)
    return PendingSample(mx.concatenate(picked), logprob_rows, params_list)


def _masked_rows(logits: mx.array, states: list[SamplerState]) -> dict[int, mx.array]:
    """Row index -> its (1, V) float32 logits under its grammar's mask, for the
    constrained rows; one mask and one pass over all of them."""
    rows = [i for i, state in enumerate(states) if state.constrained]
    if not rows:
        return {}
    constraints = [cast(ConstraintState, states[i].constraint) for i in rows]
    allowed = batch_masks(constraints, logits.shape[-1])
    picked = logits if len(rows) == len(states) else logits[mx.array(rows, dtype=mx.int32)]
    masked = _apply_mask(allowed, picked.astype(mx.float32))
    return {row: masked[j : j + 1] for j, row in enumerate(rows)}


@mx.compile
def _apply_mask(allowed: mx.array, logits: mx.array) -> mx.array:
    """Disallowed tokens to -inf, in one fused pass. NaN logits (a numerically broken
    step) would sample an arbitrary, disallowed token; as 0 they leave a uniform
    choice among the tokens the grammar allows."""
    return mx.where(allowed, mx.where(mx.isnan(logits), 0.0, logits), -mx.inf)


def sample_rows(
    logits: mx.array, params_list: list[SamplingParams], states: list[SamplerState]
) -> list[SampledRow]:
    """Pick one token per row of (B, V) logits; one mx.eval for the whole batch."""
    if any(s.constrained for s in states):
        # The forward runs while the grammar masks are filled.
        mx.async_eval(logits)
    return sample_lazy(logits, params_list, states).take()


def _with_logprobs(token: int, params: SamplingParams, logprobs: mx.array | None) -> SampledRow:
    if logprobs is None:
        return SampledRow(token, None, None)
    chosen = cast(float, logprobs[token].item())
    top: tuple[tuple[int, float], ...] | None = None
    if params.top_logprobs > 0:
        order = mx.argpartition(-logprobs, params.top_logprobs - 1)[: params.top_logprobs]
        values = logprobs[order]
        pairs = zip(int_list(order), cast(list[float], values.tolist()), strict=True)
        top = tuple(sorted(pairs, key=lambda pair: -pair[1]))
    return SampledRow(token, chosen, top)
