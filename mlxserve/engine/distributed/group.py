"""The ranks `mlx.launch` started, and the collectives that carry a step's plan between them."""

from __future__ import annotations

import logging
import zlib
from typing import Any

import mlx.core as mx

from mlxserve.engine.distributed.stdin import let_go_of_stdin
from mlxserve.engine.distributed.wakeup import PlanWakeup, open_wakeup, rank0_address
from mlxserve.engine.sampling import int_list

logger = logging.getLogger("mlxserve.distributed")

# A rank joins the ranks before it imports or loads anything else, but the ranks still
# start apart (ssh, a cold disk, a busy machine), and MLX's ring backend gives the peer
# it connects to about 31 s to listen before `init` fails. Asking again is safe (a failed
# `init` keeps no group): four tries wait about two minutes for a slow rank.
JOIN_ATTEMPTS = 4

# Ints the first collective of a step carries: a decode-only plan fits, so a
# step costs one collective; a longer plan sends the rest in a second one.
HEAD_INTS = 256


class PeerLost(RuntimeError):
    """A collective failed: another rank is gone. The engine cannot go on."""


class PlanGroup:
    """The ranks, and the plan's broadcast over them (an `all_sum` where only rank 0 adds).

    With a `wakeup` channel, a follower waiting for a broadcast sleeps on a socket
    until rank 0 is about to send, instead of busy-polling inside the collective."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(group.rank())
        self.size = int(group.size())
        self.wakeup: PlanWakeup | None = None

    def total(self, values: list[int]) -> list[int]:
        """The sum over the ranks of each rank's `values` (the same length on each)."""
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
        self.meet()
        head = [0] * HEAD_INTS
        if values is not None:
            head[0] = len(values)
            first = values[: HEAD_INTS - 1]
            head[1 : 1 + len(first)] = first
        got = self.total(head)
        count = got[0]
        body = got[1 : 1 + min(count, HEAD_INTS - 1)]
        rest = count - len(body)
        if rest > 0:
            tail = values[HEAD_INTS - 1 :] if values is not None else [0] * rest
            body += self.total(tail)
        return body

    def meet(self) -> None:
        """Rank 0: a collective follows; a follower: sleep until rank 0 says one does
        (with no wake-up channel, nothing: the collective itself waits)."""
        if self.wakeup is None:
            return
        try:
            if self.rank == 0:
                self.wakeup.notify()
            else:
                self.wakeup.wait()
        except OSError as e:
            raise PeerLost(f"rank {self.rank}: the plan channel failed: {e}") from e

    def barrier(self) -> None:
        self.total([1])

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


def shared_budget(group: PlanGroup, budget_bytes: int, bytes_per_token: float) -> int:
    """Rank 0's KV byte budget for as many tokens as the tightest rank can hold.

    Every rank holds its shard of every cache, so the rank with the least room
    (in tokens of its own cache cost) bounds what rank 0 may admit."""
    per_token = max(bytes_per_token, 1.0)
    tokens = min(int(budget_bytes / per_token), 2**31 - 1)
    fewest = group.minimum(tokens)
    return min(budget_bytes, int(fewest * per_token))


def join_group() -> PlanGroup:
    """This process's place among the ranks `mlx.launch` started (RuntimeError if alone,
    or if a peer did not come up in `JOIN_ATTEMPTS` tries)."""
    let_go_of_stdin()
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        try:
            group = mx.distributed.init()
            break
        except RuntimeError as e:
            if attempt == JOIN_ATTEMPTS:
                raise
            logger.warning(
                "joining the ranks failed (%s); try %d of %d", e, attempt + 1, JOIN_ATTEMPTS
            )
    if group.size() < 2:
        raise RuntimeError(
            "--distributed needs several ranks: start it with mlx.launch "
            "(e.g. mlx.launch --hostfile hosts.json -- mlxserve serve MODEL --distributed pipeline)"
        )
    ranks = PlanGroup(group)
    ranks.wakeup = open_wakeup(ranks.rank, ranks.size, ranks.total, rank0_address())
    return ranks
