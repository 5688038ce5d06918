"""How many prompt tokens a step can feed and still end on time (latency-bounded chunking).

While other requests decode or wait, a step that feeds a long prompt's chunk
holds back every stream's next token until it ends. The pacer learns this
model's speed from the steps it has run and sizes the prefill so a step takes
about the target time: `--max-step-ms`, or by default `STEP_TIME_FACTOR`
times a decode step of the running batch (of the smallest batch measured when
nobody decodes: what a request arriving now would see), so a streaming
client's inter-token latency stays within a small multiple of its solo latency
while a long prompt prefills beside it.

A prefill forward costs a fixed part (weights read, per-layer overhead) plus
a part per token (which grows with the context, through attention): the pacer
fits `seconds = fixed + per_token * tokens` to recent chunk forwards
(exponentially weighted least squares), so small chunks are sized as well as
large ones. Chunk sizes vary little, so one odd measurement (a small chunk
that happened to run slow) can tilt that line, and far from its samples a
tilted line promises a chunk many times too long: above the mean chunk size
the fit has seen, a chunk is costed at the mean rate instead (seconds per
token of the chunks seen, never below the line there), so chunks grow only
as fast as the measurements follow them. A chunk that ran far slower than
expected is learned as only `MAX_SLOWDOWN` times slower, so a slowdown is
learned over a few chunks and a lone stall does not swing the fit.

A prompt that prefills alone is paced to the same target: nobody waits on
its step yet, but a request that arrives now waits for the step in flight
before it can join the next one (about half a chunk, on average), so that step
must stay short too. Only where the fixed part of a forward is large (a big
model's weights read on every chunk) are its chunks made longer, so that the
fixed part stays within `ALONE_MAX_FIXED_SHARE` of each: a prompt prefilling
alone keeps most of its throughput.
"""

from __future__ import annotations

import math

from mlxserve.engine.plan import StepResult

# Default step target, in decode steps: a decoding stream gets about half of
# each step while a long prompt prefills beside it.
STEP_TIME_FACTOR = 2.0
# A prompt prefilling with nothing else running: the most of a chunk's time
# its fixed cost may take.
ALONE_MAX_FIXED_SHARE = 0.25
# Fresh prompts, with nobody decoding, are fed whole when they take at most
# this many step targets: cutting one that short adds a forward's fixed cost
# to its own first token, for a newcomer's wait that stays small anyway.
FRESH_PROMPT_FACTOR = 2.0
# The weight of the newest measurement in the moving averages.
SMOOTHING = 0.2
# A chunk that ran more than this many times slower than expected is learned
# as only this slow: one stall (a cache growing, a busy core) says little of
# the next chunk, and a small chunk's stall would tilt the fitted line.
MAX_SLOWDOWN = 2.0
# A chunk is never cut below this, so a long prompt always progresses.
MIN_CHUNK_TOKENS = 4


class _Fit:
    """Exponentially weighted least squares of seconds against tokens."""

    def __init__(self) -> None:
        self.n = self.t = self.nn = self.nt = 0.0
        self.samples = 0

    def add(self, tokens: float, seconds: float) -> None:
        w = 1.0 if self.samples == 0 else SMOOTHING
        self.n += w * (tokens - self.n)
        self.t += w * (seconds - self.t)
        self.nn += w * (tokens * tokens - self.nn)
        self.nt += w * (tokens * seconds - self.nt)
        self.samples += 1

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before any sample."""
        if self.samples == 0 or self.n <= 0:
            return None
        var = self.nn - self.n * self.n
        if var > 1e-6 * self.n * self.n:
            slope = (self.nt - self.n * self.t) / var
            fixed = self.t - slope * self.n
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, self.t / self.n  # one chunk size seen so far: all per token

    def mean_rate(self) -> float:
        """Seconds per token of the chunks seen (the line's slope through the origin)."""
        return self.t / self.n


class Pacer:
    """Moving estimates of this model's step costs, and the prefill tokens a step can afford."""

    def __init__(self, max_step_ms: float | None = None) -> None:
        self.max_step_s = None if max_step_ms is None else max_step_ms / 1000.0
        self._prefill = _Fit()
        # Decode step seconds by batch size: a step of eight rows says little
        # about what one stream waits for once the others have finished.
        self._decode_s: dict[int, float] = {}

    def observe(self, result: StepResult) -> None:
        for tokens, seconds in result.prefill_chunks:
            if tokens > 0 and seconds > 0:
                if self._prefill.line() is not None:
                    seconds = min(seconds, MAX_SLOWDOWN * self.cost_s(tokens))
                self._prefill.add(tokens, seconds)
        rows = result.decode_tokens
        if rows and result.decode_s > 0:
            old = self._decode_s.get(rows)
            new = result.decode_s
            self._decode_s[rows] = new if old is None else old + SMOOTHING * (new - old)

    def decode_step_s(self, decode_rows: int) -> float | None:
        """A decode step over `decode_rows` rows, from the nearest batch size measured
        (0 rows: the smallest, what a request that arrives now would decode in)."""
        if not self._decode_s:
            return None
        wanted = decode_rows if decode_rows > 0 else min(self._decode_s)
        nearest = min(self._decode_s, key=lambda rows: (abs(rows - wanted), rows))
        return self._decode_s[nearest]

    def target_s(self, decode_rows: int = 0) -> float | None:
        """How long a step that others wait on may take (None: not measured yet)."""
        if self.max_step_s is not None:
            return self.max_step_s
        step = self.decode_step_s(decode_rows)
        return None if step is None else STEP_TIME_FACTOR * step

    def prefill_budget_s(self, decode_rows: int, alone: bool = False) -> float | None:
        """Seconds of prefill forwards a step may run (None: no bound known yet).

        `decode_rows`: the step also runs a decode batch of this many rows, whose
        time comes first. `alone`: no other request runs or waits (see the module doc).
        """
        target = self.target_s(decode_rows)
        line = self._prefill.line()
        if target is None or line is None:
            return None
        if alone:
            target = max(target, line[0] / ALONE_MAX_FIXED_SHARE)
        decoding = (self.decode_step_s(decode_rows) or 0.0) if decode_rows else 0.0
        return target - decoding

    def prefill_rate_s(self) -> float | None:
        """Seconds per prefill token of the chunks seen (None before any)."""
        return None if self._prefill.line() is None else self._prefill.mean_rate()

    def tokens_within(self, seconds: float) -> int:
        """The longest chunk whose forward fits in `seconds` (0 if none does)."""
        line = self._prefill.line()
        assert line is not None
        fixed, per_token = line
        along_line = math.floor((seconds - fixed) / per_token)
        return max(0, min(along_line, math.floor(seconds / self._prefill.mean_rate())))

    def cost_s(self, tokens: int) -> float:
        """The expected seconds of one chunk forward of `tokens` tokens."""
        line = self._prefill.line()
        assert line is not None
        fixed, per_token = line
        return max(fixed + per_token * tokens, self._prefill.mean_rate() * tokens)
