"""Rank 0's side of the plan channel: each step's plan, and its prefix-cache
journal, sent to the other ranks."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from mlxserve.engine.distributed.codec import (
    CHUNK_INITIAL,
    CHUNK_SNAPSHOT,
    JournalOp,
    PlanKind,
    WireChunk,
    WirePlan,
    encode,
)
from mlxserve.engine.distributed.group import PeerLost, PlanGroup, key_check
from mlxserve.engine.plan import StepPlan, StepResult
from mlxserve.engine.request import Request

logger = logging.getLogger(__name__)


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
