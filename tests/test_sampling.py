"""Per-request logits processing and sampling."""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_helpers import run_requests, tokens_of

from mlxserve.config import EngineConfig
from mlxserve.engine.request import SamplingParams
from mlxserve.engine.sampling import new_sampler_state, record_token, sample_rows
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load

VOCAB = 50


def _logits(rows: int = 1) -> mx.array:
    base = mx.arange(VOCAB, dtype=mx.float32) / 10.0  # token 49 is the argmax
    return mx.broadcast_to(base, (rows, VOCAB))


def _sample(params: SamplingParams, prompt: list[int] | None = None, steps: int = 1) -> list[int]:
    state = new_sampler_state(params, prompt or [])
    out = []
    for _ in range(steps):
        row = sample_rows(_logits(), [params], [state])[0]
        record_token(state, params, row.token)
        out.append(row.token)
    return out


def test_greedy_takes_the_argmax() -> None:
    assert _sample(SamplingParams()) == [49]


def test_logit_bias_forces_and_bans_tokens() -> None:
    assert _sample(SamplingParams(logit_bias=((7, 100.0),))) == [7]
    assert _sample(SamplingParams(logit_bias=((49, -100.0),))) == [48]


def test_repetition_penalty_avoids_prompt_tokens() -> None:
    assert _sample(SamplingParams(repetition_penalty=100.0), prompt=[49, 48]) == [47]


def test_presence_and_frequency_penalties_avoid_repeats() -> None:
    assert _sample(SamplingParams(presence_penalty=2.0), steps=3) == [49, 48, 47]
    assert _sample(SamplingParams(frequency_penalty=2.0), steps=3) == [49, 48, 47]


def test_top_k_one_is_greedy_and_seeded_draws_repeat() -> None:
    assert _sample(SamplingParams(temperature=1.0, top_k=1, seed=3), steps=4) == [49] * 4
    seeded = SamplingParams(temperature=2.0, seed=11)
    draws = _sample(seeded, steps=8)
    assert draws == _sample(seeded, steps=8)
    assert len(set(draws)) > 1
    assert set(_sample(SamplingParams(temperature=2.0, top_p=0.05, seed=1), steps=5)) == {49}
    assert set(_sample(SamplingParams(temperature=2.0, min_p=0.99, seed=1), steps=5)) == {49}


def test_logprobs_and_top_logprobs() -> None:
    params = SamplingParams(logprobs=True, top_logprobs=3)
    row = sample_rows(_logits(), [params], [new_sampler_state(params, [])])[0]
    expected = _logits()[0] - mx.logsumexp(_logits()[0])
    assert row.logprob == pytest.approx(float(expected[49].item()), abs=1e-5)
    assert row.top_logprobs is not None
    assert [token for token, _ in row.top_logprobs] == [49, 48, 47]


def test_stop_token_ids_end_the_request(model_dir_factory, loaded_factory) -> None:
    oracle = greedy_generate(loaded_factory("llama"), [5, 6, 7], 8, stop_at_eos=False)
    params = SamplingParams(max_tokens=8, stop_token_ids=(oracle[3],))
    path = model_dir_factory("llama")
    (events,) = run_requests(EngineConfig(), lambda: load(path), [([5, 6, 7], params, 0.0)])
    cut = oracle.index(oracle[3])
    assert tokens_of(events) == oracle[:cut]
    assert events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == cut + 1
