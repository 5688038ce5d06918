"""How many prompt tokens a step can feed and still end on time (latency-bounded chunking).

While other requests decode or wait, a step that feeds a long prompt's chunk
holds back every stream's next token until it ends. The pacer learns this
model's speed from the steps it has run (seconds per prefill token, seconds
per decode step; moving averages) and sizes the prefill so a step takes about
the target time: `--max-step-ms`, or by default `STEP_TIME_FACTOR` times a
decode step, so a streaming client's inter-token latency stays within a small
multiple of its solo latency while a long prompt prefills beside it.

A prompt that prefills alone gets `ALONE_FACTOR` times that target: nobody
waits on its step yet, but a request that arrives now waits for the step in
flight before it can join the next one, so that step must stay short too.
"""

from __future__ import annotations

import math

from mlxserve.engine.plan import StepResult

# Default step target, in decode steps: inter-token latency during a long
# prefill stays about this many times the solo one.
STEP_TIME_FACTOR = 1.5
# A prompt prefilling with nothing else running: this many step targets a chunk.
ALONE_FACTOR = 2.0
# The weight of the newest measurement in the moving averages.
SMOOTHING = 0.3
# A chunk is never cut below this (small chunks waste the prefill's batching).
MIN_CHUNK_TOKENS = 16
# Prefill forwards shorter than this say little about the per-token cost.
MIN_SAMPLE_TOKENS = 8


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


class Pacer:
    """Moving averages of this model's step costs, and the prefill tokens a step can afford."""

    def __init__(self, max_step_ms: float | None = None) -> None:
        self.max_step_s = None if max_step_ms is None else max_step_ms / 1000.0
        self.prefill_s_per_token: float | None = None
        self.decode_step_s: float | None = None

    def observe(self, result: StepResult) -> None:
        if result.prefill_tokens >= MIN_SAMPLE_TOKENS and result.prefill_s > 0:
            per_token = result.prefill_s / result.prefill_tokens
            self.prefill_s_per_token = _blend(self.prefill_s_per_token, per_token)
        if result.decode_tokens and result.decode_s > 0:
            self.decode_step_s = _blend(self.decode_step_s, result.decode_s)

    @property
    def target_s(self) -> float | None:
        """How long a step that others wait on may take (None: not measured yet)."""
        if self.max_step_s is not None:
            return self.max_step_s
        if self.decode_step_s is None:
            return None
        return STEP_TIME_FACTOR * self.decode_step_s

    def prefill_tokens(self, decoding: bool, alone: bool = False) -> int | None:
        """Prompt tokens a step may feed (None: no bound known yet).

        `decoding`: the step also runs the decode batch, whose time comes first.
        `alone`: no other request runs or waits (see the module doc).
        """
        target, per_token = self.target_s, self.prefill_s_per_token
        if target is None or per_token is None:
            return None
        if alone:
            target *= ALONE_FACTOR
        left = target - ((self.decode_step_s or 0.0) if decoding else 0.0)
        return max(MIN_CHUNK_TOKENS, math.floor(left / per_token))
