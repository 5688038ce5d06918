"""No request is ever left waiting: faults in every phase of a step, a dead engine
thread, aborts, clients that never read their stream, and deadlines."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence

import pytest
from engine_helpers import (
    KillSwitch,
    SlowModel,
    collect,
    idle,
    started_engine,
    tokens_of,
    wait_until,
    wrapped_loader,
)

from mlxserve.config import EngineConfig
from mlxserve.engine import faults
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import (
    EngineNotReady,
    EngineOverloaded,
    Request,
    RequestStatus,
    SamplingParams,
    TokenEvent,
)
from mlxserve.engine.scheduler import Scheduler
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load

A = [7, 8, 9, 10, 11]
B = [20, 21, 22]
VICTIM = [30, 31, 32, 33]


class OneShot:
    """Raises once, at `phase`, when that point touches exactly the victim request."""

    def __init__(self, phase: str, victim: str = "victim", only_victim: bool = True) -> None:
        self.phase = phase
        self.victim = victim
        self.only_victim = only_victim
        self.fired = threading.Event()
        self.fired_at = 0.0

    def __call__(self, phase: str, request_ids: Sequence[str]) -> None:
        if phase != self.phase or self.fired.is_set():
            return
        ids = list(request_ids)
        if ids == [self.victim] or (not self.only_victim and self.victim in ids):
            self.fired_at = time.monotonic()
            self.fired.set()
            raise RuntimeError(f"injected {phase} fault")


async def timed(stream: AsyncIterator[TokenEvent]) -> tuple[list[TokenEvent], float]:
    """The events of a stream and when its last one arrived."""
    events = [event async for event in stream]
    return events, time.monotonic()


def _engine(path, fault=None, **config) -> AsyncEngine:
    engine = AsyncEngine(EngineConfig(**config), lambda: load(path), fault=fault)
    engine.start()
    return engine


@pytest.mark.parametrize(
    "phase",
    [
        faults.ADMIT,
        faults.FORWARD,
        faults.SAMPLE,
        faults.SNAPSHOT,
        faults.UPDATE,
        faults.INSERT,
        faults.RELEASE,
    ],
)
def test_a_raise_in_any_phase_fails_only_the_request_it_touched(
    phase: str, model_dir_factory, loaded_factory
) -> None:
    path = model_dir_factory("llama")
    model = loaded_factory("llama")
    expected_a, expected_b = greedy_generate(model, A, 8), greedy_generate(model, B, 8)
    expected_victim = greedy_generate(model, VICTIM, 2)
    fault = OneShot(phase)

    async def main() -> None:
        engine = _engine(path, fault)
        await engine.wait_ready(timeout=120)
        try:
            a = asyncio.create_task(collect(engine.submit(A, SamplingParams(max_tokens=8), "a")))
            b = asyncio.create_task(collect(engine.submit(B, SamplingParams(max_tokens=8), "b")))
            victim, finished_at = await asyncio.wait_for(
                timed(engine.submit(VICTIM, SamplingParams(max_tokens=2), "victim")), 60
            )
            # (A release fault fires after the victim's finish event went out.)
            assert await asyncio.to_thread(fault.fired.wait, 10)
            if phase in (faults.RELEASE, faults.SNAPSHOT, faults.INSERT):
                # A release fault comes after its finish event; a failing snapshot or
                # insert costs only the prefix-cache entry, never the answer.
                assert victim[-1].finish_reason == "length"
                assert tokens_of(victim) == expected_victim
            else:
                assert finished_at >= fault.fired_at  # it ended because of the fault
                assert victim[-1].finish_reason == "error"
                assert f"injected {phase} fault" in (victim[-1].error or "")
            assert tokens_of(await asyncio.wait_for(a, 60)) == expected_a
            assert tokens_of(await asyncio.wait_for(b, 60)) == expected_b
            again = await asyncio.wait_for(
                collect(engine.submit(VICTIM, SamplingParams(max_tokens=2))), 60
            )
            assert tokens_of(again) == expected_victim
            assert await asyncio.to_thread(wait_until, lambda: idle(engine))
            assert engine.stats()["alive"]
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_failing_schedule_fails_the_running_requests_and_the_engine_goes_on(
    model_dir_factory, loaded_factory
) -> None:
    path = model_dir_factory("llama")
    fault = OneShot(faults.SCHEDULE, only_victim=False)

    async def main() -> None:
        engine = _engine(path, fault)
        await engine.wait_ready(timeout=120)
        try:
            stream = engine.submit(VICTIM, SamplingParams(max_tokens=10_000), "victim")
            events, finished_at = await asyncio.wait_for(timed(stream), 60)
            assert events[-1].finish_reason == "error"
            assert finished_at >= fault.fired_at
            after = await asyncio.wait_for(
                collect(engine.submit(A, SamplingParams(max_tokens=6))), 60
            )
            assert tokens_of(after) == greedy_generate(loaded_factory("llama"), A, 6)
            assert await asyncio.to_thread(wait_until, lambda: idle(engine))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_persistent_fault_does_not_spin(model_dir_factory) -> None:
    """A request whose prefill always raises fails once; the loop does not retry it."""
    calls: list[str] = []

    def always(phase: str, request_ids: Sequence[str]) -> None:
        if phase == faults.FORWARD and list(request_ids) == ["victim"]:
            calls.append(phase)
            raise RuntimeError("always broken")

    async def main() -> None:
        engine = _engine(model_dir_factory("llama"), always)
        await engine.wait_ready(timeout=120)
        try:
            events = await collect(engine.submit(VICTIM, SamplingParams(max_tokens=4), "victim"))
            assert events[-1].finish_reason == "error"
            # Once nothing is open the loop waits for a command: a retry would have
            # called the model again before that.
            assert await asyncio.to_thread(wait_until, lambda: idle(engine))
            assert calls == [faults.FORWARD]
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_dead_engine_thread_fails_every_open_request_at_once(model_dir_factory) -> None:
    loader, holder = wrapped_loader(model_dir_factory("llama"), KillSwitch)

    async def main() -> None:
        engine = await started_engine(EngineConfig(max_num_seqs=2), loader)
        try:
            streams = [
                engine.submit([i + 1, i + 2], SamplingParams(max_tokens=100_000)) for i in range(3)
            ]
            first = await anext(streams[0])
            assert first.token_id is not None
            holder["model"].armed.set()
            killed_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(timed(s) for s in streams)), 5)
            for events, finished_at in results:
                assert events[-1].finish_reason == "error"
                assert "the engine failed" in (events[-1].error or "")
                assert finished_at >= killed_at
            assert engine.failure is not None and "EngineKill" in engine.failure
            assert not engine.ready and not engine.stats()["alive"]
            with pytest.raises(EngineNotReady, match="engine failed"):
                engine.submit([1, 2], SamplingParams())
            assert idle(engine)  # no stream, request or cache is left behind
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_recovery_that_raises_fails_every_request_and_the_engine_goes_on(
    model_dir_factory, loaded_factory
) -> None:
    """The failure handler itself raising falls back to failing every request and a
    clean runner; the engine serves the next request."""
    release = OneShot(faults.RELEASE)
    expected = greedy_generate(loaded_factory("llama"), B, 4)

    def hook(phase: str, request_ids: Sequence[str]) -> None:
        release(phase, request_ids)
        if phase == faults.RECOVER:
            raise RuntimeError("recovery is broken too")

    async def main() -> None:
        engine = _engine(model_dir_factory("llama"), hook)
        await engine.wait_ready(timeout=120)
        try:
            long = engine.submit(A, SamplingParams(max_tokens=100_000), "long")
            victim = await collect(engine.submit(VICTIM, SamplingParams(max_tokens=2), "victim"))
            assert victim[-1].finish_reason == "length"  # sent before the release pass
            events = await asyncio.wait_for(collect(long), 60)
            assert events[-1].finish_reason == "error"
            assert "injected release fault" in (events[-1].error or "")
            assert engine.failure is None and engine.stats()["alive"]
            again = engine.submit(B, SamplingParams(max_tokens=4))
            after = await asyncio.wait_for(collect(again), 60)
            assert tokens_of(after) == expected
            assert await asyncio.to_thread(wait_until, lambda: idle(engine))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_queued_aborts_are_not_counted_as_waiting_requests(model_dir_factory) -> None:
    async def main() -> None:
        config = EngineConfig(max_num_seqs=1, max_waiting=1, prefix_cache=False)
        engine = await started_engine(config, lambda: load(model_dir_factory("llama")))
        try:
            running = engine.submit([1, 2, 3], SamplingParams(max_tokens=100_000), "running")
            await anext(running)
            for i in range(5000):
                engine.abort(f"gone-{i}")
            waiting = engine.submit([4, 5], SamplingParams(max_tokens=2))  # not a 429
            with pytest.raises(EngineOverloaded):
                engine.submit([6, 7], SamplingParams(max_tokens=2))
            await running.aclose()  # type: ignore[attr-defined]
            assert (await collect(waiting))[-1].finish_reason == "length"
            assert await asyncio.to_thread(wait_until, lambda: idle(engine))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_streams_never_read_leave_nothing_behind(model_dir_factory) -> None:
    """A client gone before its stream started: the finish (or abort) frees everything."""

    async def main() -> None:
        engine = await started_engine(EngineConfig(), lambda: load(model_dir_factory("llama")))
        try:
            unread = engine.submit([1, 2, 3], SamplingParams(max_tokens=3))
            engine.submit([4, 5, 6], SamplingParams(max_tokens=100_000), "aborted")
            engine.abort("aborted")
            assert await asyncio.to_thread(wait_until, lambda: idle(engine))
            assert engine.stats()["aborted"] == 1
            del unread
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _slow(path, delay_s: float):
    holder: dict[str, SlowModel] = {}

    def loader():
        model = load(path)
        model.model = holder["slow"] = SlowModel(model.model, delay_s)
        return model

    return loader, holder


def test_a_preempted_request_that_times_out_keeps_its_answer() -> None:
    """Preempted back into the queue with output already sent, a request that runs out
    of time ends as `length` like a decoding one; one with no output yet fails."""
    scheduler = Scheduler(EngineConfig(request_timeout_s=1.0, prefix_cache=False), frozenset())
    long_ago = time.monotonic() - 10
    preempted = Request("preempted", [1, 2, 3], SamplingParams(max_tokens=50), long_ago)
    preempted.output_ids = [7, 8]
    preempted.fill_ids = preempted.prompt_ids + preempted.output_ids
    fresh = Request("fresh", [4, 5], SamplingParams(max_tokens=50), long_ago)
    scheduler.add(preempted)
    scheduler.add(fresh)
    scheduler.schedule()
    ends = {e.request_id: e for e in scheduler.take_events() if e.finish_reason}
    assert ends["preempted"].finish_reason == "length"
    assert ends["preempted"].error is None
    assert ends["fresh"].finish_reason == "error"
    assert "timed out" in (ends["fresh"].error or "")
    assert preempted.status == RequestStatus.FINISHED_LENGTH
    assert not scheduler.waiting and scheduler.counters.timeouts == 2


def test_request_timeout_ends_a_decoding_request_as_length_and_fails_a_waiting_one(
    model_dir_factory,
) -> None:
    loader, holder = _slow(model_dir_factory("llama"), 0.02)

    async def main() -> None:
        config = EngineConfig(max_num_seqs=1, request_timeout_s=0.5, prefix_cache=False)
        engine = await started_engine(config, loader)
        holder["slow"].armed = True
        try:
            running = engine.submit([1, 2], SamplingParams(max_tokens=100_000))
            waiting = engine.submit([3, 4], SamplingParams(max_tokens=100_000))
            decoded = await asyncio.wait_for(collect(running), 10)
            assert decoded[-1].finish_reason == "length"
            assert decoded[-1].error is None
            assert len(tokens_of(decoded)) > 0
            queued = await asyncio.wait_for(collect(waiting), 10)
            assert queued[-1].finish_reason == "error"
            assert "timed out after 0.5 s" in (queued[-1].error or "")
            assert tokens_of(queued) == []
            assert engine.stats()["timeouts"] == 2
            assert await asyncio.to_thread(wait_until, lambda: idle(engine))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_stream_does_not_wait_forever_on_a_stuck_engine(model_dir_factory) -> None:
    loader, holder = _slow(model_dir_factory("llama"), 2.5)

    async def main() -> None:
        config = EngineConfig(request_timeout_s=0.2, prefix_cache=False)
        engine = await started_engine(config, loader)
        holder["slow"].armed = True
        try:
            events = await asyncio.wait_for(
                collect(engine.submit([1, 2], SamplingParams(max_tokens=4))), 10
            )
            assert events[-1].finish_reason == "error"
            assert "did not answer" in (events[-1].error or "")
        finally:
            holder["slow"].armed = False
            await engine.shutdown()

    asyncio.run(main())
