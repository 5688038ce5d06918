"""Pacer: prefill chunks sized from measured step costs to a step-time target."""

from __future__ import annotations

import pytest

from mlxserve.engine.pacing import ALONE_FACTOR, MIN_CHUNK_TOKENS, STEP_TIME_FACTOR, Pacer
from mlxserve.engine.plan import StepResult


def test_no_bound_until_measured() -> None:
    pacer = Pacer()
    assert pacer.prefill_tokens(decoding=True) is None
    pacer.observe(StepResult(decode_tokens=1, decode_s=0.01))
    assert pacer.prefill_tokens(decoding=True) is None  # prefill speed not known yet


def test_default_target_is_a_multiple_of_the_decode_step() -> None:
    pacer = Pacer()
    pacer.observe(StepResult(decode_tokens=4, decode_s=0.010))
    pacer.observe(StepResult(prefill_tokens=100, prefill_s=0.100))  # 1 ms a token
    assert pacer.target_s == pytest.approx(STEP_TIME_FACTOR * 0.010)
    # The decode batch's time comes out of the step first.
    expected = round((STEP_TIME_FACTOR - 1) * 0.010 / 0.001)
    assert pacer.prefill_tokens(decoding=True) == max(MIN_CHUNK_TOKENS, expected)
    alone = pacer.prefill_tokens(decoding=False, alone=True)
    assert alone == round(ALONE_FACTOR * STEP_TIME_FACTOR * 0.010 / 0.001)


def test_explicit_target_and_the_floor() -> None:
    pacer = Pacer(max_step_ms=50.0)
    pacer.observe(StepResult(prefill_tokens=64, prefill_s=0.064, decode_tokens=1, decode_s=0.01))
    assert pacer.prefill_tokens(decoding=False) == 50
    assert pacer.prefill_tokens(decoding=True) == 40
    slow = Pacer(max_step_ms=0.001)
    slow.observe(StepResult(prefill_tokens=64, prefill_s=1.0))
    assert slow.prefill_tokens(decoding=False) == MIN_CHUNK_TOKENS


def test_estimates_follow_the_model() -> None:
    pacer = Pacer(max_step_ms=100.0)
    for _ in range(20):
        pacer.observe(StepResult(prefill_tokens=100, prefill_s=0.2))  # 2 ms a token
    assert pacer.prefill_tokens(decoding=False) == pytest.approx(50, abs=1)
    pacer.observe(StepResult(prefill_tokens=4, prefill_s=10.0))  # too short to say much
    assert pacer.prefill_tokens(decoding=False) == pytest.approx(50, abs=1)
