"""Speculative decoding: drafts never change what a request outputs.

The oracle is a plain run. An engine whose drafter proposes that run's own
tokens, with every third draft wrong, exercises acceptance, rejection at each
draft position and the cache cut-back; its tokens must equal the plain run's,
alone and in a batch, under temperature with a seed, under a grammar, after
a prefix-cache hit, beside a chunked prefill and across a preemption. Prompt
lookup (`NgramDrafter`) and the draft pacing are checked on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_helpers import tokens_and_stats

from mlxserve.config import EngineConfig
from mlxserve.engine import core as engine_core
from mlxserve.engine.request import Constraint, SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.engine.sampling import new_sampler_state
from mlxserve.engine.spec.drafting import NgramDrafter, Speculator
from mlxserve.engine.spec.verify import verify_rows
from mlxserve.models.load import load

Job = tuple[list[int], SamplingParams]


class OracleDrafter:
    """Drafts what a plain run output next, with every `wrong_every`-th draft off by one."""

    name = "oracle"

    def __init__(self, expected: Sequence[tuple[list[int], list[int]]], wrong_every: int = 3):
        self.expected = expected
        self.wrong_every = wrong_every
        self.proposed = 0

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        for prompt, output in self.expected:
            if list(context[: len(prompt)]) == prompt:
                done = len(context) - len(prompt)
                drafts = list(output[done : done + k])
                for j in range(len(drafts)):
                    if (done + j) % self.wrong_every == self.wrong_every - 1:
                        drafts[j] = (drafts[j] + 1) % 1000
                self.proposed += len(drafts)
                return drafts
        return []

    def forget(self, request_id: str) -> None:
        pass


def _run(path: Path, jobs: list[Job], config: EngineConfig, stagger: bool = False) -> Any:
    return tokens_and_stats(config, lambda: load(path), jobs, stagger)


def _check_parity(
    path: Path,
    jobs: list[Job],
    monkeypatch: pytest.MonkeyPatch,
    config: EngineConfig | None = None,
    stagger: bool = False,
    verifiable: bool = True,
) -> dict[str, Any]:
    plain_config = config or EngineConfig()
    plain, _ = _run(path, jobs, plain_config, stagger)
    oracle = OracleDrafter([(p, out) for (p, _), out in zip(jobs, plain, strict=True)])

    def speculator(mode: str, k: int, n: int) -> Speculator:
        return Speculator(oracle, k)

    monkeypatch.setattr(engine_core, "make_speculator", speculator)
    spec_config = EngineConfig(**{**plain_config.__dict__, "speculative": "ngram"})
    drafted, stats = _run(path, jobs, spec_config, stagger)
    assert drafted == plain
    if not verifiable:  # speculation is off for caches that cannot be cut back
        assert stats["speculative"] is None and oracle.proposed == 0
        return {}
    assert oracle.proposed > 0
    return dict(stats["speculative"], preemptions=stats["preemptions"])


def _prompt(length: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 500 + 10 for i in range(length)]


# How many rows verify together: any (plain KV), one (DeepSeek-V4's transacted
# caches; V4.1's layer caches, replayed).
VERIFY_ROWS = {"llama": None, "qwen3": None, "deepseek_v4": 1, "deepseek_v41": 1}


@pytest.mark.parametrize("family", list(VERIFY_ROWS))
def test_greedy_parity_alone_and_in_a_batch(family: str, model_dir_factory, monkeypatch) -> None:
    path = model_dir_factory(family)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    limit = VERIFY_ROWS[family]
    stats = _check_parity(path, [(_prompt(12, 0), params)], monkeypatch, verifiable=limit != 0)
    if limit is not None:
        return  # one row at a time (or none): a batch decodes without drafts
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    jobs = [(_prompt(10 + 3 * i, i), params) for i in range(4)]
    batch_stats = _check_parity(path, jobs, monkeypatch)
    assert batch_stats["verify_forwards"] > 0


def test_deepseek_v41_layer_caches_replay_what_is_kept(model_dir_factory, monkeypatch) -> None:
    """A rejected draft puts V4.1's window, groups and open group back (windows
    that wrap: 16 rows; groups of 4 closing inside a verify) under temperature."""
    path = model_dir_factory("deepseek_v41")
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=4)
    stats = _check_parity(path, [(_prompt(7, 3), params)], monkeypatch)
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    # A row verifies alone while a long prompt prefills in chunks, then that one
    # joins the batch the verifies rebuilt, and the last row left drafts again.
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    jobs = [(_prompt(8, 6), greedy), (_prompt(70, 7), SamplingParams(max_tokens=8))]
    stats = _check_parity(path, jobs, monkeypatch, EngineConfig(max_num_batched_tokens=16))
    assert stats["verify_forwards"] > 0


def test_deepseek_v4_rolls_back_its_windows_under_temperature(
    model_dir_factory, monkeypatch
) -> None:
    """Pools, carried windows and the sliding window are cut back to what is kept."""
    path = model_dir_factory("deepseek_v4")
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=5)
    stats = _check_parity(path, [(_prompt(7, 2), params)], monkeypatch)
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]


def test_same_seed_same_tokens_under_temperature(model_dir_factory, monkeypatch) -> None:
    path = model_dir_factory("llama")
    jobs = [
        (_prompt(11, i), SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=i))
        for i in range(3)
    ]
    stats = _check_parity(path, jobs, monkeypatch)
    assert stats["accepted_tokens"] > 0


def test_parity_with_penalties_and_logprobs(model_dir_factory, monkeypatch) -> None:
    path = model_dir_factory("qwen3")
    params = SamplingParams(
        max_tokens=20, temperature=0.0, repetition_penalty=1.3, logprobs=True, top_logprobs=2
    )
    _check_parity(path, [(_prompt(9, 1), params), (_prompt(14, 2), params)], monkeypatch)


def test_parity_under_a_grammar(model_dir_factory, monkeypatch) -> None:
    path = model_dir_factory("llama")
    grammar = Constraint('%llguidance {}\nstart: "ab" /[0-9]{3,6}/ "cd"')
    params = SamplingParams(max_tokens=16, temperature=0.0, constraint=grammar)
    _check_parity(path, [(_prompt(8, 3), params)], monkeypatch)


def test_parity_after_a_prefix_hit_and_beside_a_chunked_prefill(
    model_dir_factory, monkeypatch
) -> None:
    path = model_dir_factory("llama")
    params = SamplingParams(max_tokens=20, temperature=0.0)
    shared = _prompt(40, 4)
    jobs = [(shared, params), (shared + _prompt(6, 5), params)]
    _check_parity(path, jobs, monkeypatch, stagger=True)
    # A long prompt prefills in chunks while the short one decodes with drafts.
    small_steps = EngineConfig(max_num_batched_tokens=16)
    _check_parity(
        path, [(_prompt(8, 6), params), (_prompt(120, 7), params)], monkeypatch, small_steps
    )


def test_parity_across_a_preemption(model_dir_factory, monkeypatch) -> None:
    path = model_dir_factory("llama")
    cost = Runner(load(path)).probe_cost()
    params = SamplingParams(max_tokens=40, temperature=0.0)
    jobs = [(_prompt(30, 8 + i), params) for i in range(3)]
    # Room for about two of the three requests: the newest is preempted and resumes.
    budget = cost.total([60, 60], batched=True)
    tight = EngineConfig(kv_memory_bytes=budget, kv_reserve_tokens=4, prefix_cache=False)
    stats = _check_parity(path, jobs, monkeypatch, tight)
    assert stats["preemptions"] >= 1


def test_verify_keeps_rows_together_up_to_the_first_miss() -> None:
    # Two rows, vocabulary 5: row 0's argmaxes are 1, 2, 3; row 1's are 4, 4, 4.
    logits = mx.full((2, 3, 5), -10.0)
    for position, token in enumerate([1, 2, 3]):
        logits[0, position, token] = 10.0
        logits[1, position, 4] = 10.0
    states = [new_sampler_state(SamplingParams(), []) for _ in range(2)]
    requests: Any = [_Row(SamplingParams()), _Row(SamplingParams())]
    kept = verify_rows(logits, requests, [[1, 2], [4, 0]], states)
    # Row 1 misses its second draft, so both rows keep two tokens.
    assert [[r.token for r in row] for row in kept] == [[1, 2], [4, 4]]


class _Row:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params


def test_ngram_drafts_follow_the_latest_earlier_match() -> None:
    drafter = NgramDrafter(3)
    assert drafter.propose("a", [5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 7], 2) == [9, 5]
    # Fewer tokens match when the longer n-gram never occurred, but never just one.
    assert drafter.propose("b", [1, 2, 9, 4, 2, 9], 2) == [4, 2]
    assert drafter.propose("c", [1, 2, 3, 4, 9, 4], 3) == []


def test_draft_length_adapts_and_a_missing_row_pauses_the_batch() -> None:
    class Fixed:
        name = "fixed"

        def __init__(self) -> None:
            self.answers: dict[str, list[int]] = {"a": [1, 2, 3], "b": [4, 5]}

        def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
            return self.answers.get(request_id, [])[:k]

        def forget(self, request_id: str) -> None:
            pass

    drafter = Fixed()
    speculator = Speculator(drafter, 3)
    a, b = _request("a"), _request("b")
    assert speculator.plan([a, b]) == {"a": [1], "b": [4]}  # drafts start at one token
    speculator.observe("a", 1, 1)
    speculator.observe("b", 1, 1)
    assert speculator.plan([a, b]) == {"a": [1, 2], "b": [4, 5]}  # one length for the batch
    speculator.observe("a", 2, 0)
    speculator.observe("a", 1, 0)  # two misses in a row: a pause
    assert speculator.plan([a]) == {}
    drafter.answers.pop("b")
    assert speculator.plan([a, b]) == {}


def _request(request_id: str) -> Any:
    from mlxserve.engine.request import Request

    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=50), 0.0)


def test_a_sliding_window_model_decodes_without_drafts(swa_model_dir, monkeypatch) -> None:
    """A window that wraps inside a verify forward loses what it held: no speculation."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    _check_parity(swa_model_dir, [(_prompt(5, 9), params)], monkeypatch, verifiable=False)


def test_metrics_show_drafts_per_drafter() -> None:
    from mlxserve.api.metrics import Metrics

    spec = {
        "drafter": "ngram",
        "draft_tokens": 12,
        "accepted_tokens": 9,
        "verify_forwards": 4,
        "tokens_per_forward": 3.25,
    }
    text = Metrics().render([("m", {"speculative": spec}, True)])
    assert 'mlxserve_spec_accepted_tokens_total{drafter="ngram",model_name="m"} 9.0' in text
    assert 'mlxserve_spec_tokens_per_forward{drafter="ngram",model_name="m"} 3.25' in text
    assert "mlxserve_spec_" not in Metrics().render([("m", {"speculative": None}, True)])
