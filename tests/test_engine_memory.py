"""Memory is admitted, not hoped for: the measured KV cost, the byte budget, preemption."""

from __future__ import annotations

import asyncio
import logging
import time

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import ModelWrapper, collect, idle, started_engine, tokens_of, wait_until

from mlxserve.bench.memory import Scenario, measure
from mlxserve.cache.arrays import cache_nbytes
from mlxserve.cache.prefix_cache import PrefixCache
from mlxserve.config import EngineConfig
from mlxserve.engine.budget import CacheCost, KVBudget, default_kv_budget, fit_cost
from mlxserve.engine.plan import RequestOutput, StepResult
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.engine.scheduler import Scheduler
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.vision import PromptImage


def test_fit_cost_lies_above_a_block_allocated_cache() -> None:
    block, per_token = 256, 100
    samples = [(n, per_token * block * -(-n // block)) for n in (1, 5, 255, 257, 300, 511, 513)]
    cost = fit_cost(samples)
    assert cost.bytes_per_token == per_token
    for n in range(1, 2000, 7):
        assert cost.row(n) >= per_token * block * -(-n // block)


def test_batch_cost_pads_every_row_to_the_longest() -> None:
    cost = CacheCost(fixed_bytes=10, bytes_per_token=2.0)
    assert cost.total([5, 100], batched=True) == 2 * (10 + 200)
    assert cost.total([5, 100], batched=False) == (10 + 10) + (10 + 200)
    assert cost.total([], batched=True) == 0


def test_default_budget_is_device_memory_less_weights_and_a_margin() -> None:
    gib = 1 << 30
    assert default_kv_budget(4 * gib, device_bytes=16 * gib) == 16 * gib - 4 * gib - int(1.6 * gib)
    assert default_kv_budget(40 * gib, device_bytes=16 * gib) == 64 << 20  # never below 64 MiB


def test_prefix_cache_set_limit_evicts_lru_first() -> None:
    cache = PrefixCache(1000, 10, copy=list, offset=None)
    for i in range(4):
        cache.insert([i + 1, 50], ["x"], nbytes=100)
    assert cache.lookup([1, 50, 9]) is not None  # the oldest is now the most recent
    assert cache.set_limit(250) == 200
    assert cache.nbytes == 200
    assert cache.peek([1, 50, 9]) == 2 and cache.peek([4, 50, 9]) == 2


@pytest.mark.parametrize("family", ["llama", "deepseek_v4", "deepseek_v41"])
def test_probe_bounds_the_real_cache_of_every_length(family: str, loaded_factory) -> None:
    model = loaded_factory(family)
    runner = Runner(model)
    cost = runner.probe_cost()
    for length in (1, 9, 130):
        cache = model.make_cache()
        prompt = [(i * 13 + 5) % model.vocab_size for i in range(length)]
        mx.eval(model.model.last_logits(mx.array([prompt], dtype=mx.int32), cache))
        assert cache_nbytes(cache) <= cost.row(length)
        for step in range(1, 6):
            mx.eval(model.model.last_logits(mx.array([[step]], dtype=mx.int32), cache))
            assert cache_nbytes(cache) <= cost.row(length + step), (length, step)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "deepseek_v4"])
def test_sixteen_long_requests_fit_a_small_budget(family: str, model_dir_factory) -> None:
    """All complete (some wait, some are preempted) with solo greedy tokens, within budget."""
    figures = measure(model_dir_factory(family), Scenario(requests=16))
    assert figures["completed"] == 16
    assert figures["greedy_identical"] == 16
    assert figures["preemptions"] >= 1
    assert 0 < figures["peak_cache_bytes"] <= figures["budget_bytes"]
    assert figures["left_open"] == 0


def test_a_request_that_cannot_fit_fails_instead_of_waiting(model_dir_factory) -> None:
    path = model_dir_factory("llama")

    async def main() -> None:
        engine = await started_engine(EngineConfig(kv_memory_bytes=1000), lambda: load(path))
        try:
            events = await asyncio.wait_for(collect(engine.submit([1, 2, 3], SamplingParams())), 30)
            assert events[-1].finish_reason == "error"
            assert "--kv-memory-bytes 1000" in (events[-1].error or "")
            assert await asyncio.to_thread(wait_until, lambda: idle(engine))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_lone_request_that_outgrows_the_budget_fails(model_dir_factory, loaded_factory) -> None:
    path = model_dir_factory("deepseek_v41")
    cost = Runner(loaded_factory("deepseek_v41")).probe_cost(reuse=True)
    budget = cost.row(3 + 20)
    config = EngineConfig(kv_memory_bytes=budget, kv_reserve_tokens=0, prefix_cache=False)

    async def main() -> None:
        engine = await started_engine(config, lambda: load(path))
        try:
            params = SamplingParams(max_tokens=500, ignore_eos=True)
            events = await asyncio.wait_for(collect(engine.submit([1, 2, 3], params)), 60)
            assert events[-1].finish_reason == "error"
            assert "does not fit in the memory budget" in (events[-1].error or "")
            assert 0 < len(tokens_of(events)) < 500
            assert engine.stats()["peak_cache_bytes"] <= budget
        finally:
            await engine.shutdown()

    asyncio.run(main())


OOM_TOKEN = 4077


class OutOfMemory(ModelWrapper):
    """Raises MLX's allocation error for inputs holding `OOM_TOKEN`."""

    def check(self, inputs: mx.array) -> None:
        if OOM_TOKEN in inputs.reshape(-1).tolist():
            raise RuntimeError("[malloc] Unable to allocate 1099511627776 bytes.")


def test_an_allocation_error_fails_its_request_and_serving_goes_on(
    model_dir_factory, loaded_factory, caplog
) -> None:
    def loader():
        model = load(model_dir_factory("llama"))
        model.model = OutOfMemory(model.model)
        return model

    clean = [7, 8, 9, 10]
    expected = greedy_generate(loaded_factory("llama"), clean, 6)

    async def main() -> None:
        with caplog.at_level(logging.INFO, logger="mlxserve.engine.core"):
            engine = await started_engine(EngineConfig(), loader)
        try:
            good = asyncio.create_task(collect(engine.submit(clean, SamplingParams(max_tokens=6))))
            bad = await collect(engine.submit([3, OOM_TOKEN], SamplingParams(max_tokens=6)))
            assert bad[-1].finish_reason == "error" and "Unable to allocate" in (
                bad[-1].error or ""
            )
            assert tokens_of(await good) == expected
            after = await collect(engine.submit(clean, SamplingParams(max_tokens=6)))
            assert tokens_of(after) == expected
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert any("KV memory budget" in r.getMessage() for r in caplog.records)


def test_a_model_the_memory_probe_cannot_drive_is_refused(model_dir_factory) -> None:
    """No silent fallback to serving without a byte budget: the load fails, saying why."""
    from mlxserve.engine.async_engine import AsyncEngine
    from mlxserve.engine.request import EngineNotReady

    class Unprobeable(ModelWrapper):
        def check(self, inputs: object) -> None:
            raise RuntimeError("this forward cannot run")

    def loader() -> LoadedModel:
        model = load(model_dir_factory("llama"))
        model.model = Unprobeable(model.model)
        return model

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(), loader)
        engine.start()
        try:
            with pytest.raises(EngineNotReady, match="could not measure this model's KV cache"):
                await engine.wait_ready(timeout=120)
            assert "this forward cannot run" in (engine.load_error or "")
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _image_request(request_id: str, tokens: int, images: tuple[PromptImage, ...]) -> Request:
    params = SamplingParams(max_tokens=4)
    request = Request(request_id, list(range(1, tokens + 1)), params, time.monotonic())
    request.images = images
    return request


def test_image_features_count_in_the_admission_until_the_prefill_passes_them() -> None:
    """One token costs 1 byte, one image position's features 100: an image request holds
    its 16 positions' features until a chunk passes the image, and a text request waits
    for them; a budget its tokens alone would fit fails it (the features count too)."""
    image = PromptImage(start=4, length=16, sha256="0" * 64, pixels=np.zeros((1,)))
    cost = CacheCost(fixed_bytes=0, bytes_per_token=1.0)
    config = EngineConfig(kv_reserve_tokens=0, prefix_cache=False)
    need = 30 + 16 * 100

    def scheduler(budget: int) -> Scheduler:
        memory = KVBudget(budget, cost, batched=False, feature_bytes_per_position=100)
        return Scheduler(config, frozenset(), memory=memory)

    steps = scheduler(need + 29)  # room for the image request and 29 more tokens
    shot, text = _image_request("shot", 30, (image,)), _image_request("text", 30, ())
    assert shot.feature_positions == 16 and text.feature_positions == 0
    steps.add(shot)
    steps.add(text)
    steps.schedule()
    assert [r.request_id for r in steps.running] == ["shot"]
    steps.update(StepResult(outputs=[RequestOutput("shot", computed=image.end - 1)]))
    steps.schedule()
    assert shot.feature_positions == 16 and [r.request_id for r in steps.running] == ["shot"]
    steps.update(StepResult(outputs=[RequestOutput("shot", computed=image.end)]))
    steps.schedule()
    assert shot.feature_positions == 0
    assert [r.request_id for r in steps.running] == ["shot", "text"]

    tight = scheduler(need - 1)
    tight.add(_image_request("big", 30, (image,)))
    tight.schedule()
    events = tight.take_events()
    assert events[-1].finish_reason == "error" and "memory budget" in (events[-1].error or "")
