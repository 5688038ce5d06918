"""The distributed step plan on the wire: a flat int32 vector, no pickles.

Rank 0 sends one `WirePlan` per step (`engine/distributed.py`); the other
ranks rebuild the `StepPlan` their runner needs from it. Requests are named by
small integer handles; a request's prompt crosses once, its output tokens
cross as they are sampled (a delta per step), and the prefix cache's decisions
cross as a journal of entry ids. Every field is a list of ints, so encoding is
one pass and a decode-only step is a few dozen ints.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum

# Two's-complement int32 bounds: every value on the wire must fit.
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class PlanKind(IntEnum):
    STEP = 1  # run this plan (possibly empty: a heartbeat)
    STOP = 2  # rank 0 is stopping normally: exit 0


class JournalOp(IntEnum):
    # (entry id, key length, key checksum): the snapshot of that key is now an entry.
    STORE = 1
    # (entry id, 0, 0): the entry left the prefix cache (evicted, superseded, taken).
    DROP = 2
    # (entry id, handle, reused tokens, taken): a lookup handed request `handle`
    # the entry's cache, trimmed to `reused` tokens; `taken`: the entry itself.
    HIT = 3


# Prefill chunk flags.
CHUNK_INITIAL = 1  # its first chunk starts from the request's prefix-cache hit
CHUNK_SNAPSHOT = 2  # snapshot the cache after the chunk


@dataclass(frozen=True)
class WireChunk:
    handle: int
    start: int
    end: int
    flags: int = 0


@dataclass
class WirePlan:
    kind: PlanKind = PlanKind.STEP
    # (handle, prompt ids) of requests the other ranks have not seen yet.
    new_requests: list[tuple[int, list[int]]] = field(default_factory=list)
    # (handle, output tokens appended since the last plan).
    tokens: list[tuple[int, list[int]]] = field(default_factory=list)
    # Requests preempted since the last plan (their cache is rebuilt from prompt + output).
    preempted: list[int] = field(default_factory=list)
    # (handle, key length): `prompt + output` snapshots the last run took on rank 0
    # (decode rows its sampled token ended); the others take them before the journal.
    finishing: list[tuple[int, int]] = field(default_factory=list)
    # (op, a, b, c) in the order rank 0's prefix cache made them (see JournalOp).
    journal: list[tuple[int, int, int, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    completed: list[tuple[int, int]] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)
    prefills: list[WireChunk] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (
            self.new_requests
            or self.tokens
            or self.preempted
            or self.finishing
            or self.journal
            or self.released
            or self.completed
            or self.decodes
            or self.prefills
        )


class PlanDecodeError(ValueError):
    """The received vector is not a plan this version wrote (the ranks are out of step)."""


def _check(value: int) -> int:
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise ValueError(f"{value} does not fit the plan's int32 encoding")
    return value


def encode(plan: WirePlan) -> list[int]:
    """The plan as a flat list of int32 values (see `decode`)."""
    out: list[int] = [int(plan.kind)]
    out.append(len(plan.new_requests))
    for handle, ids in plan.new_requests:
        out += [handle, len(ids), *ids]
    out.append(len(plan.tokens))
    for handle, ids in plan.tokens:
        out += [handle, len(ids), *ids]
    out += [len(plan.preempted), *plan.preempted]
    out.append(len(plan.finishing))
    for handle, length in plan.finishing:
        out += [handle, length]
    out.append(len(plan.journal))
    for op in plan.journal:
        out += op
    out += [len(plan.released), *plan.released]
    out.append(len(plan.completed))
    for handle, length in plan.completed:
        out += [handle, length]
    out += [len(plan.decodes), *plan.decodes]
    out.append(len(plan.prefills))
    for chunk in plan.prefills:
        out += [chunk.handle, chunk.start, chunk.end, chunk.flags]
    for value in out:
        _check(value)
    return out


class _Reader:
    def __init__(self, values: list[int]) -> None:
        self._values = values
        self._at = 0

    def take(self, n: int = 1) -> list[int]:
        if n < 0 or self._at + n > len(self._values):
            raise PlanDecodeError("the plan ends early")
        part = self._values[self._at : self._at + n]
        self._at += n
        return part

    def one(self) -> int:
        return self.take()[0]

    def count(self) -> int:
        n = self.one()
        if n < 0:
            raise PlanDecodeError(f"negative count {n}")
        return n

    def groups(self, width: int) -> Iterator[list[int]]:
        for _ in range(self.count()):
            yield self.take(width)

    def runs(self) -> list[tuple[int, list[int]]]:
        found = []
        for _ in range(self.count()):
            handle = self.one()
            found.append((handle, self.take(self.count())))
        return found

    def done(self) -> None:
        if self._at != len(self._values):
            raise PlanDecodeError(f"{len(self._values) - self._at} values after the plan's end")


def decode(values: list[int]) -> WirePlan:
    """Rebuild a plan written by `encode`; PlanDecodeError if it is not one."""
    reader = _Reader(values)
    try:
        kind = PlanKind(reader.one())
    except ValueError as e:
        raise PlanDecodeError(f"unknown plan kind: {e}") from e
    plan = WirePlan(kind=kind)
    plan.new_requests = reader.runs()
    plan.tokens = reader.runs()
    plan.preempted = reader.take(reader.count())
    plan.finishing = [(h, n) for h, n in reader.groups(2)]
    plan.journal = [(op, a, b, c) for op, a, b, c in reader.groups(4)]
    plan.released = reader.take(reader.count())
    plan.completed = [(h, n) for h, n in reader.groups(2)]
    plan.decodes = reader.take(reader.count())
    plan.prefills = [WireChunk(h, s, e, f) for h, s, e, f in reader.groups(4)]
    reader.done()
    return plan
