"""Distributed serving: rank 0 decides, every rank executes (rule 12 of docs/architecture.md).

Rank 0 runs the HTTP server, the scheduler, the prefix cache's policy and the
sampler. Before each run it sends the step's plan (`plan_codec.WirePlan`)
with one `mx.distributed` collective (two for a long prompt), and every rank
runs the same `Runner` forwards on its shard of the model: tensor parallel
forwards sum inside each layer, pipeline forwards pass the hidden state from
stage to stage, so no rank can run ahead of the others.

Only rank 0's sampled tokens count: they reach the other ranks in the next
plan, whose runners feed them (decode-ahead is off, since it would feed a
rank's own draws). The other ranks hold their shard of every prefix-cache
entry; rank 0's prefix cache reports each decision (`PrefixCacheObserver`)
and the followers replay that journal, so an entry is created, handed out
and dropped on every rank together. A collective that fails (a peer gone)
raises `PeerLost`, which ends the engine: open requests fail, `/health`
turns 503.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxserve.cache.snapshot import share_cache, trim_cache
from mlxserve.cache.trie import pack
from mlxserve.engine.plan import PrefillChunk, StepPlan, StepResult
from mlxserve.engine.plan_codec import (
    CHUNK_INITIAL,
    CHUNK_SNAPSHOT,
    JournalOp,
    PlanKind,
    WireChunk,
    WirePlan,
    decode,
    encode,
)
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.engine.sampling import int_list
from mlxserve.models.loaded import LoadedModel

logger = logging.getLogger(__name__)

# Ints the first collective of a step carries: a decode-only plan fits, so a
# step costs one collective; a longer plan sends the rest in a second one.
HEAD_INTS = 256
MODES = ("tensor", "pipeline")
# Followers only run the forward; what they draw is never used.
_FOLLOWER_PARAMS = SamplingParams(max_tokens=2**31 - 1)


class PeerLost(RuntimeError):
    """A collective failed: another rank is gone. The engine cannot go on."""


class PlanGroup:
    """The ranks, and the plan's broadcast over them (an `all_sum` where only rank 0 adds)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(group.rank())
        self.size = int(group.size())

    def _sum(self, values: list[int]) -> list[int]:
        try:
            total = mx.distributed.all_sum(
                mx.array(values, dtype=mx.int32), group=self.group, stream=mx.cpu
            )
            mx.eval(total)
        except RuntimeError as e:  # the ring backend's "connection to a peer was lost"
            raise PeerLost(f"rank {self.rank}: a collective failed: {e}") from e
        return int_list(total)

    def broadcast(self, values: list[int] | None) -> list[int]:
        """Rank 0's `values` on every rank (others pass None)."""
        head = [0] * HEAD_INTS
        if values is not None:
            head[0] = len(values)
            first = values[: HEAD_INTS - 1]
            head[1 : 1 + len(first)] = first
        got = self._sum(head)
        total = got[0]
        body = got[1 : 1 + min(total, HEAD_INTS - 1)]
        rest = total - len(body)
        if rest > 0:
            tail = values[HEAD_INTS - 1 :] if values is not None else [0] * rest
            body += self._sum(tail)
        return body

    def barrier(self) -> None:
        self._sum([1])

    def minimum(self, value: int) -> int:
        """The smallest of each rank's `value` (int32 range), e.g. a memory budget in KiB."""
        try:
            every = mx.distributed.all_gather(
                mx.array([value], dtype=mx.int32), group=self.group, stream=mx.cpu
            )
            mx.eval(every)
        except RuntimeError as e:
            raise PeerLost(f"rank {self.rank}: a collective failed: {e}") from e
        return min(int_list(every))


def key_check(key: bytes) -> int:
    """A checksum that names a snapshot's key on the wire (with its length)."""
    return zlib.crc32(key) & 0x7FFFFFFF


@dataclass
class _Hit:
    entry_id: int
    reused: int
    taken: bool
    cache: list[Any]


class PlanPublisher:
    """Rank 0's side: turns each `StepPlan` into a `WirePlan` and sends it.

    It is also the prefix cache's observer (`attach`), keeping the journal of
    entries stored, dropped and handed out since the last plan.
    """

    def __init__(self, group: PlanGroup) -> None:
        self.group = group
        self._handles: dict[str, int] = {}
        self._live: dict[int, Request] = {}
        self._sent_tokens: dict[int, int] = {}
        self._next_handle = 0
        self._journal: list[tuple[int, int, int, int] | _Hit] = []
        self._finishing: list[tuple[str, int]] = []
        self.steps = 0
        self.broadcast_s = 0.0

    # -- the prefix cache's observer ----------------------------------------
    def stored(self, entry_id: int, key: bytes) -> None:
        self._journal.append((JournalOp.STORE, entry_id, len(key) // 4, key_check(key)))

    def dropped(self, entry_id: int) -> None:
        self._journal.append((JournalOp.DROP, entry_id, 0, 0))

    def hit(self, entry_id: int, reused: int, taken: bool, cache: list[Any]) -> None:
        self._journal.append(_Hit(entry_id, reused, taken, cache))

    # -- each step ----------------------------------------------------------
    def publish(self, plan: StepPlan, holders: list[Request]) -> None:
        """Send `plan`; `holders`: requests that may hold a prefix-cache hit's cache."""
        wire = WirePlan()

        def handle(request: Request) -> int:
            return self._handle(request, wire)

        prefills = [
            WireChunk(
                handle(c.request),
                c.start,
                c.end,
                (CHUNK_INITIAL if c.initial_cache is not None else 0)
                | (CHUNK_SNAPSHOT if c.snapshot_after else 0),
            )
            for c in plan.prefills
        ]
        decodes = [handle(r) for r in plan.decodes]
        wire.journal = self._resolve_journal(holders, wire)
        wire.tokens = self._token_deltas()
        wire.preempted = self._known(plan.preempted)
        wire.finishing = [(self._handles[rid], n) for rid, n in self._finishing]
        wire.completed = [
            (self._handles[rid], len(key)) for rid, key in plan.completed if rid in self._handles
        ]
        wire.released = self._known(plan.released)
        wire.decodes, wire.prefills = decodes, prefills
        self._finishing = []
        self._send(encode(wire))
        for rid in plan.released:
            number = self._handles.pop(rid, None)
            if number is not None:
                self._live.pop(number, None)
                self._sent_tokens.pop(number, None)

    def ran(self, plan: StepPlan, result: StepResult) -> None:
        """Note the `prompt + output` snapshots this run took of finishing decode rows:
        the other ranks take theirs before the next plan's journal stores them."""
        completed = {rid for rid, _ in plan.completed}
        for output in result.outputs:
            snapshot = output.snapshot
            if snapshot is None or output.computed is not None or output.request_id in completed:
                continue
            if output.request_id in self._handles:
                self._finishing.append((output.request_id, len(snapshot.key_ids)))

    def stop(self) -> bool:
        """Tell the other ranks that rank 0 stops normally; False if a peer is gone.
        The last journal goes with it, so every rank ends holding the same entries."""
        wire = WirePlan(kind=PlanKind.STOP)
        wire.journal = self._resolve_journal([], wire)
        wire.tokens = self._token_deltas()
        wire.finishing = [(self._handles[rid], n) for rid, n in self._finishing]
        wire.released = list(self._live)
        try:
            self._send(encode(wire))
        except PeerLost:
            logger.warning("could not tell the other ranks to stop: a peer is gone already")
            return False
        return True

    # -- helpers --------------------------------------------------------------
    def _send(self, values: list[int]) -> None:
        started = time.perf_counter()
        self.group.broadcast(values)
        self.broadcast_s += time.perf_counter() - started
        self.steps += 1

    def _handle(self, request: Request, wire: WirePlan) -> int:
        number = self._handles.get(request.request_id)
        if number is None:
            number = self._next_handle
            self._next_handle += 1
            self._handles[request.request_id] = number
            self._live[number] = request
            self._sent_tokens[number] = 0
            wire.new_requests.append((number, list(request.prompt_ids)))
        return number

    def _known(self, request_ids: list[str]) -> list[int]:
        return [self._handles[rid] for rid in request_ids if rid in self._handles]

    def _token_deltas(self) -> list[tuple[int, list[int]]]:
        deltas = []
        for number, request in self._live.items():
            sent = self._sent_tokens[number]
            if len(request.output_ids) > sent:
                deltas.append((number, request.output_ids[sent:]))
                self._sent_tokens[number] = len(request.output_ids)
        return deltas

    def _resolve_journal(
        self, holders: list[Request], wire: WirePlan
    ) -> list[tuple[int, int, int, int]]:
        """The journal with each hit named by the request that holds its cache
        (-1: none does any more, e.g. its admission failed)."""
        by_cache = {id(r.cache): r for r in holders if r.cache is not None}
        ops: list[tuple[int, int, int, int]] = []
        for op in self._journal:
            if isinstance(op, _Hit):
                holder = by_cache.get(id(op.cache))
                number = -1 if holder is None else self._handle(holder, wire)
                ops.append((JournalOp.HIT, op.entry_id, number, op.reused * 2 + int(op.taken)))
            else:
                ops.append(op)
        self._journal = []
        return ops


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


def shared_budget(group: PlanGroup, budget_bytes: int, bytes_per_token: float) -> int:
    """Rank 0's KV byte budget for as many tokens as the tightest rank can hold.

    Every rank holds its shard of every cache, so the rank with the least room
    (in tokens of its own cache cost) bounds what rank 0 may admit."""
    per_token = max(bytes_per_token, 1.0)
    tokens = min(int(budget_bytes / per_token), 2**31 - 1)
    fewest = group.minimum(tokens)
    return min(budget_bytes, int(fewest * per_token))


def join_group() -> PlanGroup:
    """This process's place among the ranks `mlx.launch` started (RuntimeError if alone)."""
    group = mx.distributed.init()
    if group.size() < 2:
        raise RuntimeError(
            "--distributed needs several ranks: start it with mlx.launch "
            "(e.g. mlx.launch --hostfile hosts.json -- mlxserve serve MODEL --distributed pipeline)"
        )
    return PlanGroup(group)
