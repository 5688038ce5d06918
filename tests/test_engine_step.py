"""One step is schedule -> run -> update: decode rows and prefill chunks in one run,
rows that join mid-prefill, paced chunks; greedy identity with single runs is the oracle."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from engine_helpers import ModelWrapper, run_requests, tokens_of

from mlxserve.config import EngineConfig
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.engine.scheduler import Scheduler
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load


class Counting(ModelWrapper):
    """Counts model calls and the rows and tokens of each."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: list[tuple[int, int]] = []

    def check(self, inputs: mx.array) -> None:
        self.calls.append((int(inputs.shape[0]), int(inputs.shape[1])))


def _ids(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + i * 104_729) % 120_000 + 100 for i in range(count)]


@pytest.mark.parametrize("family", ["llama", "deepseek_v4"])
def test_a_step_is_three_calls_over_decode_rows_and_chunks(family: str, model_dir_factory) -> None:
    """Driven by hand on this thread: each step is one schedule, one run, one update;
    a step that both decodes and prefills runs one decode forward plus its chunks
    (its decode forward ran in the step before when that step ran ahead)."""
    model = load(model_dir_factory(family))
    expected = {
        "a": greedy_generate(model, _ids(1, 5), 12),
        "b": greedy_generate(model, _ids(2, 70), 4),
        "c": greedy_generate(model, _ids(3, 9), 6),
    }
    counting = Counting(model.model)
    model.model = counting
    config = EngineConfig(max_num_batched_tokens=24, prefix_cache=False)
    scheduler = Scheduler(config, model.eos_token_ids)
    runner = Runner(model)
    prompts = {"a": _ids(1, 5), "b": _ids(2, 70), "c": _ids(3, 9)}
    limits = {"a": 12, "b": 4, "c": 6}
    produced: dict[str, list[int]] = {rid: [] for rid in prompts}
    arrivals = {0: ["a"], 2: ["b"], 4: ["c"]}  # b and c join while a decodes
    mixed = ahead_steps = 0
    for step in range(200):
        for rid in arrivals.get(step, []):
            params = SamplingParams(max_tokens=limits[rid])
            scheduler.add(Request(rid, prompts[rid], params, arrival_time=float(step)))
        if not scheduler.running and not scheduler.waiting:
            break
        plan = scheduler.schedule()
        before = len(counting.calls)
        ran_ahead = runner.batch.ahead is not None
        result = runner.run(plan)
        scheduler.update(result)
        calls = counting.calls[before:]
        chunks = [(1, c.num_tokens) for c in plan.prefills]
        if plan.decodes and plan.prefills:
            mixed += 1
            # One forward over every decode row, then one per prefill chunk.
            decode = [] if ran_ahead else [(len(plan.decodes), 1)]
            assert calls == decode + chunks
        if runner.batch.ahead is not None:
            ahead_steps += 1
            assert not plan.prefills
            assert calls[-1] == (len(runner.batch.request_ids), 1)
        assert plan.num_tokens <= config.max_num_batched_tokens
        for event in scheduler.take_events():
            if event.token_id is not None:
                produced[event.request_id].append(event.token_id)
    assert mixed > 0 and ahead_steps > 0
    assert produced == expected


@pytest.mark.parametrize("family", ["llama", "deepseek_v4"])
def test_paced_chunks_keep_greedy_identity(family: str, model_dir_factory) -> None:
    """A tiny step target cuts prompts into minimum-size chunks while others decode;
    short prompts join mid-prefill; every output equals its single run."""
    path = model_dir_factory(family)
    model = load(path)
    prompts = [_ids(4, 150), _ids(5, 6), _ids(6, 40), _ids(7, 3)]
    max_tokens = [5, 10, 6, 8]
    expected = [greedy_generate(model, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    jobs = [
        (p, SamplingParams(max_tokens=n), delay)
        for p, n, delay in zip(prompts, max_tokens, [0.0, 0.0, 0.05, 0.1], strict=True)
    ]
    config = EngineConfig(max_num_batched_tokens=64, max_step_ms=0.001, prefix_cache=False)
    results = run_requests(config, lambda: load(path), jobs)
    assert [tokens_of(events) for events in results] == expected


def test_whole_prompts_that_arrive_together_prefill_in_one_forward(model_dir_factory) -> None:
    model = load(model_dir_factory("llama"))
    prompts = {"a": _ids(8, 20), "b": _ids(9, 17), "c": _ids(10, 14), "tiny": _ids(11, 2)}
    expected = {rid: greedy_generate(model, p, 5) for rid, p in prompts.items()}
    counting = Counting(model.model)
    model.model = counting
    scheduler = Scheduler(EngineConfig(prefix_cache=False), model.eos_token_ids)
    runner = Runner(model)
    for rid, prompt in prompts.items():
        scheduler.add(Request(rid, prompt, SamplingParams(max_tokens=5), arrival_time=0.0))
    produced: dict[str, list[int]] = {rid: [] for rid in prompts}
    first = True
    while scheduler.running or scheduler.waiting:
        plan = scheduler.schedule()
        before = len(counting.calls)
        scheduler.update(runner.run(plan))
        if first:
            # a, b and c share one left-padded forward; the 2-token prompt would
            # pad it too much and prefills alone.
            assert len(plan.prefills) == 4
            assert sorted(counting.calls[before:]) == [(1, 2), (3, 20)]
            first = False
        for event in scheduler.take_events():
            if event.token_id is not None:
                produced[event.request_id].append(event.token_id)
    assert produced == expected
