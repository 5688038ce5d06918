"""Pacer: prefill chunks sized from measured step costs to a step-time target."""

from __future__ import annotations

import pytest

from mlxserve.engine.pacing import ALONE_FACTOR, MIN_CHUNK_TOKENS, STEP_TIME_FACTOR, Pacer
from mlxserve.engine.plan import StepResult


def _chunk(tokens: int, seconds: float) -> StepResult:
    return StepResult(prefill_tokens=tokens, prefill_chunks=[(tokens, seconds)])


def test_no_bound_until_measured() -> None:
    pacer = Pacer()
    assert pacer.prefill_tokens(decoding=True) is None
    pacer.observe(StepResult(decode_tokens=1, decode_s=0.01))
    assert pacer.prefill_tokens(decoding=True) is None  # prefill speed not known yet


def test_default_target_is_a_multiple_of_the_decode_step() -> None:
    pacer = Pacer()
    pacer.observe(StepResult(decode_tokens=4, decode_s=0.010))
    pacer.observe(_chunk(100, 0.100))  # one size seen: 1 ms a token
    assert pacer.target_s == pytest.approx(STEP_TIME_FACTOR * 0.010)
    # The decode batch's time comes out of the step first.
    expected = (STEP_TIME_FACTOR - 1) * 0.010 / 0.001
    assert pacer.prefill_tokens(decoding=True) == pytest.approx(expected, abs=1)
    alone = pacer.prefill_tokens(decoding=False, alone=True)
    assert alone == pytest.approx(ALONE_FACTOR * STEP_TIME_FACTOR * 0.010 / 0.001, abs=1)


def test_fixed_cost_is_fitted_apart_from_the_cost_per_token() -> None:
    pacer = Pacer(max_step_ms=30.0)
    for _ in range(10):  # 10 ms a forward + 0.5 ms a token
        for tokens in (8, 64, 256):
            pacer.observe(_chunk(tokens, 0.010 + 0.0005 * tokens))
    assert pacer.prefill_tokens(decoding=False) == pytest.approx(40, abs=1)


def test_explicit_target_and_the_floor() -> None:
    pacer = Pacer(max_step_ms=50.0)
    pacer.observe(_chunk(64, 0.064))
    pacer.observe(StepResult(decode_tokens=1, decode_s=0.01))
    assert pacer.prefill_tokens(decoding=False) == pytest.approx(50, abs=1)
    assert pacer.prefill_tokens(decoding=True) == pytest.approx(40, abs=1)
    slow = Pacer(max_step_ms=0.001)
    slow.observe(_chunk(64, 1.0))
    assert slow.prefill_tokens(decoding=False) == MIN_CHUNK_TOKENS


def test_estimates_follow_the_model() -> None:
    pacer = Pacer(max_step_ms=100.0)
    for _ in range(40):
        pacer.observe(_chunk(100, 0.2))  # 2 ms a token
    assert pacer.prefill_tokens(decoding=False) == pytest.approx(50, abs=1)
    for _ in range(40):
        pacer.observe(_chunk(100, 0.4))  # a longer context: 4 ms a token
    assert pacer.prefill_tokens(decoding=False) == pytest.approx(25, abs=1)
