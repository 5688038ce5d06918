"""A rank > 0: receives each plan from rank 0, replays its prefix-cache journal,
runs the same forwards."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from mlxserve.cache.snapshot import share_cache, trim_cache
from mlxserve.cache.trie import pack
from mlxserve.engine.distributed.codec import (
    CHUNK_INITIAL,
    CHUNK_SNAPSHOT,
    JournalOp,
    PlanKind,
    WirePlan,
    decode,
)
from mlxserve.engine.distributed.group import PlanGroup, key_check
from mlxserve.engine.plan import PrefillChunk, StepPlan, StepResult
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.models.loaded import LoadedModel

logger = logging.getLogger(__name__)

# Followers only run the forward; what they draw is never used.
_FOLLOWER_PARAMS = SamplingParams(max_tokens=2**31 - 1)


class PlanDesync(RuntimeError):
    """A follower was told to use something it does not hold: the ranks disagree."""


@dataclass
class _Entry:
    snapshot: list[Any]
    key_len: int


class Follower:
    """A rank > 0: receive each plan, replay rank 0's prefix-cache journal, run the plan."""

    def __init__(self, model: LoadedModel, group: PlanGroup, plan_timeout_s: float | None) -> None:
        self.group = group
        self.runner = Runner(model, decode_ahead=False)
        self.requests: dict[int, Request] = {}
        self.entries: dict[int, _Entry] = {}
        # Snapshots this rank took that rank 0's journal has not stored (or refused) yet.
        self.pending: dict[tuple[int, int], list[Any]] = {}
        self.plan_timeout_s = plan_timeout_s
        # When the current wait for a plan, or the current plan's run, began.
        self._since = time.monotonic()
        self.steps = 0

    def serve(self) -> int:
        """Run plans until rank 0 stops (0) or a peer is lost (raises PeerLost)."""
        if self.plan_timeout_s is not None:
            threading.Thread(
                target=self._watch, name="mlxserve-follower-watch", daemon=True
            ).start()
        while True:
            self._since = time.monotonic()
            values = self.group.broadcast(None)
            self._since = time.monotonic()
            wire = decode(values)
            if wire.kind == PlanKind.STOP:
                self._prelude(wire)
                self.runner.release([str(n) for n in wire.released])
                for number in wire.released:
                    self.requests.pop(number, None)
                logger.info("rank %d: rank 0 stopped; exiting", self.group.rank)
                return 0
            if not wire.empty:
                self.apply(wire)
                self.steps += 1

    def _watch(self) -> None:
        """No plan (not even an idle heartbeat) for `plan_timeout_s`, or a plan that runs
        that long (a collective that never completes): a peer is stuck. A collective
        cannot be cancelled, so the process leaves."""
        timeout = self.plan_timeout_s
        assert timeout is not None
        stopped = threading.Event()  # never set: the process ends with its main thread
        while not stopped.wait(min(1.0, timeout / 4)):
            if time.monotonic() - self._since > timeout:
                logger.critical(
                    "rank %d: no progress with rank 0 for %g s; exiting", self.group.rank, timeout
                )
                logging.shutdown()
                os._exit(1)

    def apply(self, wire: WirePlan) -> None:
        """Run one plan: what changed since the last one first, then the step itself."""
        self._prelude(wire)
        result = self.runner.run(self._plan(wire))
        for output in result.outputs:
            if output.error is not None:
                logger.warning(
                    "rank %d: request %s: %s", self.group.rank, output.request_id, output.error
                )
        self._keep(result)
        for number in wire.released:
            self.requests.pop(number, None)

    def _prelude(self, wire: WirePlan) -> None:
        """New requests, tokens, preemptions, finishing snapshots and the journal."""
        for number, ids in wire.new_requests:
            self.requests[number] = Request(str(number), ids, _FOLLOWER_PARAMS, 0.0)
        for number, ids in wire.tokens:
            self.requests[number].output_ids += ids
        for number in wire.preempted:
            request = self.requests[number]
            request.fill_ids = (
                request.prompt_ids + request.output_ids if request.output_ids else None
            )
            request.cache = None
        if wire.finishing:
            completed = [(str(n), self._key(n, length)) for n, length in wire.finishing]
            self._keep(self.runner.run(StepPlan(completed=completed)))
        self._replay(wire.journal)
        self.pending.clear()

    def _plan(self, wire: WirePlan) -> StepPlan:
        plan = StepPlan(
            released=[str(n) for n in wire.released],
            completed=[(str(n), self._key(n, length)) for n, length in wire.completed],
            preempted=[str(n) for n in wire.preempted],
            decodes=[self.requests[n] for n in wire.decodes],
        )
        for chunk in wire.prefills:
            request = self.requests[chunk.handle]
            initial = None
            if chunk.flags & CHUNK_INITIAL:
                initial, request.cache = request.cache, None
                if initial is None:
                    raise PlanDesync(
                        f"request {chunk.handle} has no prefix-cache hit to start from"
                    )
            snapshot = bool(chunk.flags & CHUNK_SNAPSHOT)
            plan.prefills.append(PrefillChunk(request, chunk.start, chunk.end, initial, snapshot))
        return plan

    def _key(self, number: int, length: int) -> list[int]:
        request = self.requests[number]
        return (request.prompt_ids + request.output_ids)[:length]

    def _keep(self, result: StepResult) -> None:
        for output in result.outputs:
            if output.snapshot is not None:
                key = pack(output.snapshot.key_ids)
                self.pending[(len(output.snapshot.key_ids), key_check(key))] = output.snapshot.cache

    def _replay(self, journal: list[tuple[int, int, int, int]]) -> None:
        for op, entry_id, b, c in journal:
            if op == JournalOp.STORE:
                snapshot = self.pending.pop((b, c), None)
                if snapshot is None:
                    logger.error(
                        "rank %d: no snapshot for prefix-cache entry %d", self.group.rank, entry_id
                    )
                else:
                    self.entries[entry_id] = _Entry(snapshot, b)
            elif op == JournalOp.DROP:
                self.entries.pop(entry_id, None)
            elif op == JournalOp.HIT:
                self._hit(entry_id, b, c // 2, bool(c % 2))
            else:
                raise PlanDesync(f"unknown journal op {op}")

    def _hit(self, entry_id: int, number: int, reused: int, taken: bool) -> None:
        entry = self.entries.get(entry_id)
        if entry is None:
            raise PlanDesync(f"prefix-cache entry {entry_id} is not held on this rank")
        if taken:
            del self.entries[entry_id]
            cache = entry.snapshot
        else:
            cache = share_cache(entry.snapshot)
            if reused < entry.key_len:
                trim_cache(cache, entry.key_len - reused)
        if number >= 0:
            self.requests[number].cache = cache
