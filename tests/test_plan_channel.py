"""The distributed plan channel without mx.distributed: a publisher and a follower in
one process, joined by a queue, each with a whole (unsharded) copy of the model.

Both copies compute the same numbers, so whatever the follower's caches and
prefix-cache entries hold must equal rank 0's exactly: that checks that the
plan says everything the runner needs (tokens, chunks, hits, releases,
preemptions) and that the journal creates, hands out and drops entries on
the follower as rank 0's prefix cache does.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxserve.cache.snapshot import cache_arrays
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.distributed.codec import (
    PlanDecodeError,
    PlanKind,
    WireChunk,
    WirePlan,
    decode,
    encode,
)
from mlxserve.engine.distributed.follower import Follower
from mlxserve.engine.distributed.group import PeerLost
from mlxserve.engine.distributed.publisher import PlanPublisher
from mlxserve.engine.request import SamplingParams
from mlxserve.models.load import load

ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)
small = st.lists(ints, max_size=5)


@given(
    new=st.lists(st.tuples(ints, small), max_size=3),
    tokens=st.lists(st.tuples(ints, small), max_size=3),
    journal=st.lists(st.tuples(ints, ints, ints, ints), max_size=4),
    decodes=small,
    chunks=st.lists(st.tuples(ints, ints, ints, ints), max_size=3),
    pairs=st.lists(st.tuples(ints, ints), max_size=3),
)
def test_a_plan_survives_the_wire(
    new: list[tuple[int, list[int]]],
    tokens: list[tuple[int, list[int]]],
    journal: list[tuple[int, int, int, int]],
    decodes: list[int],
    chunks: list[tuple[int, int, int, int]],
    pairs: list[tuple[int, int]],
) -> None:
    plan = WirePlan(
        new_requests=new,
        tokens=tokens,
        preempted=decodes[:2],
        finishing=pairs,
        journal=journal,
        released=decodes[1:],
        completed=pairs[::-1],
        decodes=decodes,
        prefills=[WireChunk(*c) for c in chunks],
    )
    assert decode(encode(plan)) == plan


def test_a_damaged_plan_is_refused() -> None:
    values = encode(WirePlan(decodes=[1, 2, 3]))
    with pytest.raises(PlanDecodeError):
        decode(values[:-1])
    with pytest.raises(PlanDecodeError):
        decode([*values, 0])
    with pytest.raises(PlanDecodeError):
        decode([99, *values[1:]])
    with pytest.raises(ValueError, match="int32"):
        encode(WirePlan(decodes=[2**31]))
    assert decode(encode(WirePlan(kind=PlanKind.STOP))).kind == PlanKind.STOP


class QueueGroup:
    """Rank 0 and one follower in one process: a broadcast is a queue put / get."""

    def __init__(self, rank: int, plans: queue.Queue[list[int]]) -> None:
        self.rank, self.size = rank, 2
        self._plans = plans

    def broadcast(self, values: list[int] | None) -> list[int]:
        if values is not None:
            self._plans.put(values)
            return values
        try:
            return self._plans.get(timeout=60)
        except queue.Empty as e:
            raise PeerLost("no plan from rank 0") from e

    def minimum(self, value: int) -> int:
        return value

    def meet(self) -> None:
        """No wake-up channel: a queue's get already sleeps."""


def _same(a: list[Any], b: list[Any]) -> bool:
    xs, ys = cache_arrays(a), cache_arrays(b)
    return len(xs) == len(ys) and all(
        x.shape == y.shape and bool(mx.array_equal(x, y)) for x, y in zip(xs, ys, strict=True)
    )


async def _traffic(engine: AsyncEngine, vocab: int, max_tokens: int) -> list[list[int]]:
    engine.start()
    await engine.wait_ready()
    long = [(i * 37 + 5) % vocab for i in range(150)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt: list[int], stop_after: int | None = None) -> list[int]:
        out: list[int] = []
        async for event in engine.submit(prompt, params):
            if event.token_id is not None:
                out.append(event.token_id)
            if stop_after is not None and len(out) >= stop_after:
                break  # the client leaves: the engine aborts it
        return out

    try:
        first = await asyncio.gather(
            one(long), one(long[:20] + [7, 8, 9]), one([3, 4, 5, 6]), one([9, 9, 9], 2)
        )
        # A hit on the long prompt's entry, and one that branches off it.
        second = await asyncio.gather(one(long + [11, 12]), one(long[:100] + [1, 2, 3]))
        return [*first, *second]
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("kv_tight", [False, True])
def test_a_follower_holds_what_rank_0_holds(
    model_dir_factory: Callable[..., Path], kv_tight: bool
) -> None:
    path = model_dir_factory("llama")
    plans: queue.Queue[list[int]] = queue.Queue()
    publisher = PlanPublisher(QueueGroup(0, plans))  # type: ignore[arg-type]
    follower = Follower(load(path), QueueGroup(1, plans), None)  # type: ignore[arg-type]
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(follower.serve()), daemon=True)
    thread.start()
    max_tokens = 24 if kv_tight else 6
    budget = None
    if kv_tight:
        # Room for the long prompt and a short one as they start: as they grow, the
        # newest is preempted (and prefilled again later, from prompt + output).
        cost = follower.runner.probe_cost()
        budget = cost.total([160, 30], batched=follower.runner.batchable)
    config = EngineConfig(
        max_num_batched_tokens=32,
        kv_memory_bytes=budget,
        kv_reserve_tokens=2,
        distributed="pipeline",
    )
    engine = AsyncEngine(config, lambda: load(path), publisher=publisher)
    outputs = asyncio.run(_traffic(engine, 1000, max_tokens))
    thread.join(30)
    assert status == [0]
    assert all(outputs), outputs
    cache = engine._core.prefix_cache
    assert cache is not None and len(cache) > 0
    held = {entry.entry_id: entry for entry in cache._lru.values()}
    assert set(follower.entries) == set(held)
    for entry_id, entry in held.items():
        assert follower.entries[entry_id].key_len == entry.key_len
        assert _same(follower.entries[entry_id].snapshot, entry.snapshot)
    assert not follower.requests, "every request was released on the follower"
    assert not follower.runner.caches and not follower.runner.batch.request_ids
    if kv_tight:
        assert engine.stats()["preemptions"] > 0


def test_a_rank_asks_again_when_its_peer_is_not_up_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX's ring backend gives a peer about 31 s to listen; a slower rank 0 is asked again
    (a failed `init` keeps no group), and after `JOIN_ATTEMPTS` tries the error stands."""
    from mlxserve.engine.distributed import group as group_module

    class TwoRanks:
        def rank(self) -> int:
            return 1

        def size(self) -> int:
            return 2

    failures = [RuntimeError("[ring] Couldn't connect (error: 111)")] * 2
    calls: list[int] = []

    def init() -> TwoRanks:
        calls.append(1)
        if failures:
            raise failures.pop()
        return TwoRanks()

    monkeypatch.setattr(group_module.mx.distributed, "init", init)
    monkeypatch.setattr(group_module, "open_wakeup", lambda *args: None)
    joined = group_module.join_group()
    assert (joined.rank, joined.size, len(calls)) == (1, 2, 3)
    failures.extend([RuntimeError("[ring] Couldn't connect (error: 111)")] * 9)
    calls.clear()
    with pytest.raises(RuntimeError, match="Couldn't connect"):
        group_module.join_group()
    assert len(calls) == group_module.JOIN_ATTEMPTS
