"""Decoding ahead: a step starts the next decode step before reading its own tokens.

The oracle is the same run with decoding ahead off: every row's tokens and
logprobs are the same, whether rows finish, are aborted or join while a step
is in flight; rows whose sampling needs the tokens so far never run ahead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mlxserve.cache.prefix_cache import PrefixCache
from mlxserve.config import EngineConfig
from mlxserve.engine import faults
from mlxserve.engine.request import Constraint, Request, RequestStatus, SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.engine.scheduler import Scheduler
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel


def _ids(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + i * 104_729) % 120_000 + 100 for i in range(count)]


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    arrives: int = 0
    aborted_at: int | None = None
    # Stopped from outside at this step, as a matched stop string stops a request.
    stopped_at: int | None = None


@dataclass
class Driven:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    ahead_steps: int = 0
    # Steps that decoded some rows and fed prompt chunks of others.
    mixed_steps: int = 0


def drive(
    model: LoadedModel,
    jobs: dict[str, Job],
    decode_ahead: bool,
    prefix_cache: PrefixCache | None = None,
    fault=None,
) -> Driven:
    """Step the engine's three calls by hand on this thread until every job ends."""
    config = EngineConfig(max_num_batched_tokens=64, prefix_cache=prefix_cache is not None)
    scheduler = Scheduler(config, model.eos_token_ids, prefix_cache)
    runner = Runner(model, fault, decode_ahead=decode_ahead)
    out = Driven({rid: [] for rid in jobs}, {rid: [] for rid in jobs})
    for step in range(300):
        for rid, job in jobs.items():
            if job.arrives == step:
                scheduler.add(Request(rid, job.prompt, job.params, arrival_time=float(step)))
            if job.aborted_at == step:
                scheduler.abort(rid)
            if job.stopped_at == step:
                scheduler.abort(rid, RequestStatus.FINISHED_STOPPED)
        if step > max(j.arrives for j in jobs.values()) and not (
            scheduler.running or scheduler.waiting or scheduler.has_released
        ):
            break
        plan = scheduler.schedule()
        out.mixed_steps += bool(plan.decodes and plan.prefills)
        scheduler.update(runner.run(plan))
        out.ahead_steps += runner.batch.ahead is not None
        for event in scheduler.take_events():
            if event.token_id is not None:
                out.tokens[event.request_id].append(event.token_id)
                out.logprobs[event.request_id].append(event.logprob)
            if event.error is not None:
                out.errors[event.request_id] = event.error
    assert not runner.caches and not runner.batch.request_ids and runner.batch.ahead is None
    return out


def _mixed_jobs() -> dict[str, Job]:
    sampled = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=5)
    return {
        "greedy": Job(_ids(1, 7), SamplingParams(max_tokens=12)),
        "sampled": Job(_ids(2, 12), sampled),
        "logprobs": Job(_ids(3, 5), SamplingParams(max_tokens=6, logprobs=True, top_logprobs=2)),
        "late": Job(_ids(4, 9), SamplingParams(max_tokens=5), arrives=4),
        "aborted": Job(_ids(5, 6), SamplingParams(max_tokens=20), aborted_at=6),
        "stopped": Job(_ids(11, 8), SamplingParams(max_tokens=20), stopped_at=7),
        # Prefills in several chunks while the others decode.
        "long": Job(_ids(12, 150), SamplingParams(max_tokens=4), arrives=2),
    }


@pytest.mark.parametrize("family", ["llama", "deepseek_v4", "deepseek_v41"])
def test_decoding_ahead_draws_what_a_plain_step_draws(family: str, model_dir_factory) -> None:
    model = load(model_dir_factory(family))
    jobs = _mixed_jobs()
    plain = drive(model, jobs, decode_ahead=False)
    ahead = drive(model, jobs, decode_ahead=True)
    assert plain.ahead_steps == 0 and ahead.ahead_steps > 0
    assert ahead.mixed_steps >= 2
    assert ahead.tokens == plain.tokens
    assert ahead.logprobs == plain.logprobs
    assert not ahead.errors and not plain.errors
    for rid in ("greedy", "late", "long"):
        job = jobs[rid]
        assert ahead.tokens[rid] == greedy_generate(model, job.prompt, job.params.max_tokens)
    assert 0 < len(ahead.tokens["aborted"]) < 20
    assert 0 < len(ahead.tokens["stopped"]) < 20
    assert all(value is not None for value in ahead.logprobs["logprobs"])


def test_rows_that_need_their_history_run_their_forward_ahead(model_dir_factory) -> None:
    """A penalized row draws only once its tokens are read, but its forward still runs a
    step ahead: the same tokens as plain steps."""
    model = load(model_dir_factory("deepseek_v4"))
    jobs = _mixed_jobs()
    jobs["penalized"] = Job(_ids(6, 8), SamplingParams(max_tokens=30, repetition_penalty=1.3))
    plain = drive(model, jobs, decode_ahead=False)
    ahead = drive(model, jobs, decode_ahead=True)
    assert ahead.tokens == plain.tokens and ahead.logprobs == plain.logprobs
    assert ahead.ahead_steps > 0 and not ahead.errors


DIGITS = '%llguidance {}\nstart: "ab" /[0-9]{3,40}/ "cd"'


def test_constrained_rows_run_their_forward_ahead(model_dir_factory) -> None:
    """Grammar rows (one whose grammar starts only after a marker token, as after
    reasoning) decode ahead with the masks of the tokens read so far: the same tokens as
    plain steps, and every one allowed."""
    model = load(model_dir_factory("deepseek_v4"))
    prompt = _ids(7, 9)
    marker = greedy_generate(model, prompt, 4)[2]  # greedy reaches it at the third token
    jobs = {
        "free": Job(_ids(1, 7), SamplingParams(max_tokens=24)),
        "json": Job(
            _ids(8, 6),
            SamplingParams(max_tokens=24, temperature=1.0, seed=3, constraint=Constraint(DIGITS)),
        ),
        "after": Job(
            prompt,
            SamplingParams(max_tokens=16, constraint=Constraint(DIGITS, start_after=(marker,))),
        ),
    }
    plain = drive(model, jobs, decode_ahead=False)
    ahead = drive(model, jobs, decode_ahead=True)
    assert not plain.errors and not ahead.errors, (plain.errors, ahead.errors)
    assert ahead.tokens == plain.tokens and ahead.ahead_steps > 0
    text = model.tokenizer.decode(ahead.tokens["after"][3:])
    assert text.startswith("ab"), text
    # Alone, the row ran ahead from its first step: the token after the marker was once
    # drawn before the marker was read, unmasked, and the grammar rejected it.
    alone = drive(model, {"after": jobs["after"]}, decode_ahead=True)
    assert not alone.errors and alone.tokens["after"] == plain.tokens["after"]


def test_completion_snapshots_of_rows_that_ran_ahead_hold_what_they_output(
    model_dir_factory,
) -> None:
    """With the prefix cache on, a plain KV cache leaves a `prompt + output` entry as
    each row ends (by length, or stopped from outside): trimmed back to the tokens it output,
    and a request that continues from it draws what a cold run draws."""
    model = load(model_dir_factory("llama"))
    jobs = _mixed_jobs()
    cache = PrefixCache(1 << 30, 64)
    ahead = drive(model, jobs, decode_ahead=True, prefix_cache=cache)
    assert ahead.ahead_steps > 0
    assert ahead.tokens == drive(model, jobs, decode_ahead=False).tokens
    for rid, fed in (("greedy", 11), ("stopped", len(ahead.tokens["stopped"]) - 1)):
        history = jobs[rid].prompt + ahead.tokens[rid]
        assert cache.peek(history) == len(jobs[rid].prompt) + fed
    follow_up = jobs["greedy"].prompt + ahead.tokens["greedy"] + _ids(10, 4)
    warm = drive(model, {"next": Job(follow_up, SamplingParams(max_tokens=6))}, True, cache)
    assert warm.tokens["next"] == greedy_generate(model, follow_up, 6)
    assert cache.stats().hits >= 1


def test_a_step_that_fails_after_running_ahead_fails_its_rows_only(model_dir_factory) -> None:
    """A sampling failure in a step whose forward ran ahead fails that batch's rows;
    a request after it decodes as it would alone."""
    model = load(model_dir_factory("deepseek_v4"))
    samples = {"count": 0}

    def fault(phase: str, request_ids: list[str]) -> None:
        if phase == faults.SAMPLE and "doomed" in request_ids:
            samples["count"] += 1
            if samples["count"] == 4:
                raise RuntimeError("injected sampling failure")

    jobs = {
        "doomed": Job(_ids(7, 6), SamplingParams(max_tokens=12)),
        "neighbour": Job(_ids(8, 6), SamplingParams(max_tokens=12)),
        "after": Job(_ids(9, 6), SamplingParams(max_tokens=6), arrives=20),
    }
    out = drive(model, jobs, decode_ahead=True, fault=fault)
    assert set(out.errors) == {"doomed", "neighbour"}
    assert "injected sampling failure" in out.errors["doomed"]
    assert out.ahead_steps > 0
    assert out.tokens["after"] == greedy_generate(model, jobs["after"].prompt, 6)


def test_a_decode_read_after_a_chunks_graph_fails_only_the_decoding_rows(
    model_dir_factory,
) -> None:
    """In a step that also feeds a prompt chunk, the decode rows' tokens are read once
    the chunk's graph is built; a sampling failure there fails the decoding rows, and
    the prompt being fed goes on to draw what it draws alone."""
    model = load(model_dir_factory("deepseek_v4"))
    calls: list[tuple[str, list[str]]] = []

    def fault(phase: str, request_ids: list[str]) -> None:
        after_chunk = bool(calls) and calls[-1] == (faults.FORWARD, ["long"])
        calls.append((phase, list(request_ids)))
        if phase == faults.SAMPLE and request_ids == ["doomed"] and after_chunk:
            raise RuntimeError("injected sampling failure")

    jobs = {
        "doomed": Job(_ids(7, 6), SamplingParams(max_tokens=30)),
        "long": Job(_ids(12, 150), SamplingParams(max_tokens=6), arrives=2),
    }
    out = drive(model, jobs, decode_ahead=True, fault=fault)
    assert set(out.errors) == {"doomed"}
    assert "injected sampling failure" in out.errors["doomed"]
    assert out.tokens["long"] == greedy_generate(model, jobs["long"].prompt, 6)
