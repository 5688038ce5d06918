"""Pacer: prefill chunks sized from measured step costs to a step-time target."""

from __future__ import annotations

import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.pacing import (
    ALONE_MAX_FIXED_SHARE,
    FRESH_PROMPT_FACTOR,
    MIN_CHUNK_TOKENS,
    STEP_TIME_FACTOR,
    Pacer,
)
from mlxserve.engine.plan import StepPlan, StepResult
from mlxserve.engine.request import Request, RequestStatus, SamplingParams
from mlxserve.engine.scheduler import Scheduler


def _chunk(tokens: int, seconds: float) -> StepResult:
    return StepResult(prefill_tokens=tokens, prefill_chunks=[(tokens, seconds)])


def _affordable(pacer: Pacer, decode_rows: int, alone: bool = False) -> int | None:
    """The longest chunk a step's prefill budget fits (None: no bound yet), as the
    scheduler asks for it before applying its own shortest chunk."""
    budget = pacer.prefill_budget_s(decode_rows, alone)
    return None if budget is None else pacer.tokens_within(budget)


def test_no_bound_until_measured() -> None:
    pacer = Pacer()
    assert _affordable(pacer, decode_rows=1) is None
    pacer.observe(StepResult(decode_tokens=1, decode_s=0.01))
    assert _affordable(pacer, decode_rows=1) is None  # prefill speed not known yet


def test_default_target_is_a_multiple_of_the_decode_step() -> None:
    pacer = Pacer()
    pacer.observe(StepResult(decode_tokens=4, decode_s=0.010))
    pacer.observe(_chunk(100, 0.100))  # one size seen: 1 ms a token
    assert pacer.target_s() == pytest.approx(STEP_TIME_FACTOR * 0.010)
    # The decode batch's time comes out of the step first.
    expected = (STEP_TIME_FACTOR - 1) * 0.010 / 0.001
    assert _affordable(pacer, decode_rows=1) == pytest.approx(expected, abs=1)
    alone = _affordable(pacer, decode_rows=0, alone=True)
    # No fixed cost measured yet: a prompt prefilling alone is paced to the same target.
    assert alone == pytest.approx(STEP_TIME_FACTOR * 0.010 / 0.001, abs=1)


def test_fixed_cost_is_fitted_apart_from_the_cost_per_token() -> None:
    pacer = Pacer(max_step_ms=30.0)
    for _ in range(10):  # 10 ms a forward + 0.5 ms a token
        for tokens in (8, 64, 256):
            pacer.observe(_chunk(tokens, 0.010 + 0.0005 * tokens))
    assert _affordable(pacer, decode_rows=0) == pytest.approx(40, abs=1)


def test_alone_a_large_fixed_cost_lengthens_the_chunk() -> None:
    pacer = Pacer()
    pacer.observe(StepResult(decode_tokens=1, decode_s=0.010))  # target: 20 ms
    for _ in range(10):  # 10 ms a forward + 0.5 ms a token
        for tokens in (8, 64, 256):
            pacer.observe(_chunk(tokens, 0.010 + 0.0005 * tokens))
    assert _affordable(pacer, decode_rows=0) == pytest.approx(20, abs=1)
    # Alone, the fixed 10 ms may take only a share of the chunk's time.
    alone_s = 0.010 / ALONE_MAX_FIXED_SHARE
    alone = _affordable(pacer, decode_rows=0, alone=True)
    assert alone == pytest.approx((alone_s - 0.010) / 0.0005, abs=1)


def test_one_slow_small_chunk_does_not_make_the_next_chunk_run_long() -> None:
    # Seen on a tiny DeepSeek-V4: steady ~95-token chunks, then one 4-token chunk that ran
    # slow. Fitted on its own, that point tilts the line to a large fixed cost and a tiny
    # cost per token, and the next chunk alone was planned at 512 tokens (226 ms).
    def true_cost_s(tokens: int) -> float:
        return 0.0025 + 0.0002 * tokens

    pacer = Pacer()
    for _ in range(10):
        pacer.observe(StepResult(decode_tokens=1, decode_s=0.0097))
        pacer.observe(_chunk(95, true_cost_s(95)))
    before = _affordable(pacer, decode_rows=0, alone=True)
    pacer.observe(_chunk(4, 0.0116))
    target = pacer.target_s()
    assert target is not None and before is not None
    alone = _affordable(pacer, decode_rows=0, alone=True)
    assert alone is not None
    assert true_cost_s(alone) <= 2 * target
    assert alone <= 1.25 * before
    paced = _affordable(pacer, decode_rows=1)
    assert paced is not None
    assert true_cost_s(paced) <= target


def test_explicit_target_and_a_step_too_short_for_any_chunk() -> None:
    pacer = Pacer(max_step_ms=50.0)
    pacer.observe(_chunk(64, 0.064))
    pacer.observe(StepResult(decode_tokens=1, decode_s=0.01))
    assert _affordable(pacer, decode_rows=0) == pytest.approx(50, abs=1)
    assert _affordable(pacer, decode_rows=1) == pytest.approx(40, abs=1)
    slow = Pacer(max_step_ms=0.001)
    slow.observe(_chunk(64, 1.0))
    # Nothing fits: the scheduler still feeds its shortest chunk (tested below).
    assert _affordable(slow, decode_rows=0) == 0


def test_estimates_follow_the_model() -> None:
    pacer = Pacer(max_step_ms=100.0)
    for _ in range(40):
        pacer.observe(_chunk(100, 0.2))  # 2 ms a token
    assert _affordable(pacer, decode_rows=0) == pytest.approx(50, abs=1)
    for _ in range(40):
        pacer.observe(_chunk(100, 0.4))  # a longer context: 4 ms a token
    assert _affordable(pacer, decode_rows=0) == pytest.approx(25, abs=1)


def test_a_lasting_slowdown_is_still_learned() -> None:
    pacer = Pacer(max_step_ms=100.0)
    for _ in range(40):
        pacer.observe(_chunk(100, 0.1))  # 1 ms a token
    for _ in range(40):
        pacer.observe(_chunk(100, 0.5))  # five times slower from now on
    assert _affordable(pacer, decode_rows=0) == pytest.approx(20, abs=1)


def test_the_target_follows_the_size_of_the_decode_batch() -> None:
    pacer = Pacer()
    pacer.observe(_chunk(100, 0.100))
    for _ in range(5):
        pacer.observe(StepResult(decode_tokens=8, decode_s=0.080))
        pacer.observe(StepResult(decode_tokens=1, decode_s=0.020))
    assert pacer.target_s(8) == pytest.approx(STEP_TIME_FACTOR * 0.080)
    assert pacer.target_s(6) == pytest.approx(STEP_TIME_FACTOR * 0.080)  # nearest measured
    # Nobody decoding: a newcomer would decode alone, so the eight-row steps do not count.
    assert pacer.target_s(0) == pytest.approx(STEP_TIME_FACTOR * 0.020)
    alone = _affordable(pacer, decode_rows=0, alone=True)
    assert alone == pytest.approx(STEP_TIME_FACTOR * 20, abs=1)


def _prefilling(request_id: str, prompt_tokens: int, computed: int) -> Request:
    request = Request(request_id, list(range(prompt_tokens)), SamplingParams(), 0.0)
    request.status = RequestStatus.PREFILLING
    request.num_computed = computed
    return request


def _paced_scheduler(*requests: Request, min_chunk_tokens: int = MIN_CHUNK_TOKENS) -> Scheduler:
    config = EngineConfig(prefix_cache=False, max_step_ms=20.0)
    scheduler = Scheduler(config, frozenset(), min_chunk_tokens=min_chunk_tokens)
    scheduler.pacer.observe(_chunk(100, 0.100))  # 1 ms a token: 40 tokens alone
    scheduler.running.extend(requests)
    return scheduler


def test_the_tail_of_a_long_prompt_is_paced_even_when_it_fits_the_budget() -> None:
    scheduler = _paced_scheduler(_prefilling("long", 4096, 4096 - 400))
    plan = StepPlan()
    scheduler._plan_prefills(plan)
    [chunk] = plan.prefills
    assert chunk.num_tokens == pytest.approx(20, abs=1)  # not all 400


def test_a_short_prompt_alone_and_fresh_prompts_together_are_fed_whole() -> None:
    # The target is 20 ms at 1 ms a token; a fresh prompt may take FRESH_PROMPT_FACTOR targets.
    fresh_limit = int(FRESH_PROMPT_FACTOR * 20)
    plan = StepPlan()
    _paced_scheduler(_prefilling("short", fresh_limit - 10, 0))._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [fresh_limit - 10]
    plan = StepPlan()
    _paced_scheduler(_prefilling("longer", fresh_limit + 10, 0))._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [20]
    plan = StepPlan()
    _paced_scheduler(_prefilling("a", 120, 0), _prefilling("b", 200, 0))._plan_prefills(plan)
    assert sorted(c.num_tokens for c in plan.prefills) == [120, 200]


def test_a_prompt_that_ends_in_a_step_is_not_held_back_by_another_prompts_chunk() -> None:
    short, long = _prefilling("short", 10, 0), _prefilling("long", 4096, 1000)
    plan = StepPlan()
    _paced_scheduler(short, long)._plan_prefills(plan)
    # The short prompt's first token leaves when the step ends: no chunk of the long one joins.
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefills] == [("short", 10)]
    other = _prefilling("other", 8, 0)
    plan = StepPlan()
    _paced_scheduler(short, other, long)._plan_prefills(plan)
    # Another prompt that also ends within the time left still joins.
    assert sorted(c.request.request_id for c in plan.prefills) == ["other", "short"]


def test_no_chunk_is_cut_shorter_than_the_model_allows_nor_leaves_a_stub() -> None:
    # 20 ms at 1 ms a token fits 20 tokens; this model's chunks cost less from 32 up.
    long = _prefilling("long", 4096, 0)
    plan = StepPlan()
    _paced_scheduler(long, min_chunk_tokens=32)._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [32]
    # 40 tokens left: a 20-token chunk would leave a 20-token stub, so all 40 go.
    tail = _prefilling("tail", 4096, 4096 - 40)
    plan = StepPlan()
    _paced_scheduler(tail, min_chunk_tokens=32)._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [40]
    # With the default shortest chunk the same tail is cut at the pacer's 20 tokens.
    tail = _prefilling("tail", 4096, 4096 - 40)
    plan = StepPlan()
    _paced_scheduler(tail)._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [20]


def test_deepseek_v4_chunks_are_never_cut_into_its_tokenwise_blocks() -> None:
    from mlx_vlm.models.linear import DECODE_BLOCK_SIZE

    from mlxserve.models.load import min_prefill_chunk

    assert min_prefill_chunk("deepseek_v4") == DECODE_BLOCK_SIZE + 1
    assert min_prefill_chunk("qwen3") == 1


def test_a_long_prompt_progresses_even_when_no_chunk_fits_the_step() -> None:
    long = _prefilling("long", 4096, 0)
    scheduler = _paced_scheduler(long)
    for _ in range(40):
        scheduler.pacer.observe(_chunk(100, 10.0))  # far slower than the 20 ms target
    assert scheduler.pacer.tokens_within(0.020) < MIN_CHUNK_TOKENS
    plan = StepPlan()
    scheduler._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [MIN_CHUNK_TOKENS]


def _hit(request_id: str, prompt_tokens: int, hit: int) -> Request:
    """A request admitted on a prefix-cache hit of `hit` tokens, nothing fed since."""
    request = _prefilling(request_id, prompt_tokens, hit)
    request.cached_tokens = hit
    return request


def test_a_hit_suffix_alone_goes_in_two_forwards_ending_in_the_shortest_chunk() -> None:
    # Paced alone, these 232 tokens would be twelve 20-token forwards (1 ms a token, 20 ms).
    request = _hit("warm", 7000 + 232, 7000)
    scheduler = _paced_scheduler(request, min_chunk_tokens=1)  # qwen3, llama: any length
    plan = StepPlan()
    scheduler._plan_prefills(plan)
    [chunk] = plan.prefills
    assert (chunk.start, chunk.end, chunk.is_last) == (7000, 7231, False)
    request.num_computed = chunk.end
    plan = StepPlan()
    scheduler._plan_prefills(plan)
    [last] = plan.prefills
    assert (last.num_tokens, last.is_last) == (1, True)
    # A model that cannot be fed fewer tokens ends the prompt in a chunk of its own minimum.
    request = _hit("v4", 7000 + 232, 7000)
    plan = StepPlan()
    _paced_scheduler(request, min_chunk_tokens=17)._plan_prefills(plan)
    assert [c.end for c in plan.prefills] == [7000 + 232 - 17]


def test_a_hit_suffix_is_paced_beside_others_and_left_alone_where_pacing_feeds_it_whole() -> None:
    # Another prompt prefilling (or a request decoding): the suffix is paced as before.
    plan = StepPlan()
    _paced_scheduler(_hit("warm", 7232, 7000), _prefilling("long", 4096, 1000))._plan_prefills(plan)
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefills] == [("warm", 20)]
    # A suffix that one paced chunk feeds: one forward, unchanged.
    plan = StepPlan()
    _paced_scheduler(_hit("short", 7015, 7000))._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [15]
    # Over the token budget: paced.
    plan = StepPlan()
    _paced_scheduler(_hit("huge", 7000 + 4000, 7000))._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [20]
    # Once its first chunk is fed, the rest of a hit is paced like any prompt's tail.
    plan = StepPlan()
    request = _hit("fed", 7232, 7000)
    request.num_computed = 7020
    _paced_scheduler(request)._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [20]


def test_a_deep_model_feeds_a_hit_suffix_whole_where_a_split_would_cost_a_forward() -> None:
    """One more forward costs about a decode step; ending the prompt in the big chunk costs
    its last layer over every position, 1/L of it: on a deep model the split does not pay."""
    decode = StepResult(decode_tokens=1, decode_s=0.030)  # 30 ms a forward, as on Metal
    shallow = _paced_scheduler(_hit("a", 7232, 7000), min_chunk_tokens=1)
    shallow.pacer.observe(decode)
    shallow.sizer.num_layers = 2  # 232 tokens x 1 ms / 2 layers = 116 ms > 30 ms: split
    plan = StepPlan()
    shallow._plan_prefills(plan)
    assert [(c.num_tokens, c.is_last) for c in plan.prefills] == [(231, False)]
    deep = _paced_scheduler(_hit("b", 7232, 7000), min_chunk_tokens=1)
    deep.pacer.observe(decode)
    deep.sizer.num_layers = 43  # 232 / 43 = 5.4 ms < 30 ms: one chunk ends the prompt
    plan = StepPlan()
    deep._plan_prefills(plan)
    assert [(c.num_tokens, c.is_last) for c in plan.prefills] == [(232, True)]


@pytest.mark.parametrize(("layers", "first_chunk"), [(2, 231), (43, 232)])
def test_a_fresh_engine_splits_a_hit_suffix_only_on_a_shallow_model(
    layers: int, first_chunk: int
) -> None:
    """Right after a start (a restore from disk) nothing is measured yet."""
    scheduler = Scheduler(
        EngineConfig(prefix_cache=False), frozenset(), min_chunk_tokens=1, num_layers=layers
    )
    scheduler.running.append(_hit("restored", 7232, 7000))
    plan = StepPlan()
    scheduler._plan_prefills(plan)
    assert [c.num_tokens for c in plan.prefills] == [first_chunk]
