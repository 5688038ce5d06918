"""The prefix cache's write-behind policy: what it hands the disk tier, and when.

An entry is written when it is created, when it has grown by `disk_every`
tokens since its last write, before RAM evicts it, and at shutdown; a longer
entry replaces what it supersedes on disk, and entries RAM keeps apart (branch
points) stay on disk. A recording stand-in plays the disk tier here.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import pytest

from mlxserve.cache.prefix_cache import PrefixCache


class RecordingDisk:
    """Duck-types the two calls the prefix cache makes on `DiskTier`."""

    def __init__(self) -> None:
        self.stored: set[tuple[int, ...]] = set()
        self.writes: list[tuple[int, frozenset[int]]] = []

    def recorded_lengths(self, key_ids: Sequence[int]) -> list[int]:
        key = tuple(key_ids)
        return [len(k) for k in self.stored if key[: len(k)] == k]

    def write(self, key_ids: Sequence[int], snapshot: list[Any], keep: Collection[int]) -> None:
        key = tuple(key_ids)
        self.stored = {k for k in self.stored if not (key[: len(k)] == k and len(k) not in keep)}
        self.stored.add(key)
        self.writes.append((len(key), frozenset(keep)))


def _cache(disk: RecordingDisk, every: int = 100, max_bytes: int = 10_000) -> PrefixCache:
    return PrefixCache(
        max_bytes,
        64,
        copy=lambda s: list(s),
        offset=None,
        trimmable=lambda s: False,
        disk=disk,  # type: ignore[arg-type]
        disk_every=every,
    )


def _ids(n: int, seed: int = 0) -> list[int]:
    return [seed * 1000 + i + 1 for i in range(n)]


def test_a_growing_conversation_is_written_when_created_then_every_n_tokens() -> None:
    disk = RecordingDisk()
    cache = _cache(disk, every=100)
    for length in (50, 80, 149, 150, 200, 260):
        cache.insert(_ids(length), ["snap"], nbytes=10)
    # Created at 50; 80 and 149 grew by less than 100; 150 grew by 100; 260 by 110.
    assert [n for n, _ in disk.writes] == [50, 150, 260]
    assert disk.stored == {tuple(_ids(260))}  # each write replaced the one before


def test_dirty_entries_are_written_before_eviction_and_at_shutdown() -> None:
    disk = RecordingDisk()
    cache = _cache(disk, every=1000, max_bytes=25)
    cache.insert(_ids(10, seed=1), ["a"], nbytes=10)
    cache.insert(_ids(20, seed=1), ["a2"], nbytes=10)  # dirty: grew by 10
    cache.insert(_ids(10, seed=2), ["b"], nbytes=10)
    cache.insert(_ids(20, seed=2), ["b2"], nbytes=10)  # dirty
    assert [n for n, _ in disk.writes] == [10, 10]
    cache.insert(_ids(10, seed=3), ["c"], nbytes=10)  # evicts seed 1's dirty entry
    assert sorted(n for n, _ in disk.writes[2:]) == [10, 20]
    assert tuple(_ids(20, seed=1)) in disk.stored
    assert cache.flush_to_disk() == 1  # seed 2's entry
    assert tuple(_ids(20, seed=2)) in disk.stored
    assert cache.flush_to_disk() == 0


def test_an_entry_restored_from_disk_is_not_written_again() -> None:
    disk = RecordingDisk()
    disk.stored.add(tuple(_ids(40)))
    cache = _cache(disk)
    cache.insert(_ids(40), ["restored"], nbytes=10)
    assert disk.writes == [] and cache.flush_to_disk() == 0


def test_a_branch_point_ram_keeps_stays_on_disk() -> None:
    """A shared system prompt kept in RAM at a branch point is not superseded on disk."""
    disk = RecordingDisk()
    cache = _cache(disk, every=100)
    system = _ids(40)
    cache.insert(system, ["system"], nbytes=10)
    cache.insert([*system, 7, 7], ["a"], nbytes=10)  # supersedes the system prompt in RAM
    cache.insert(system, ["system again"], nbytes=10)  # a branch point now
    cache.insert([*system, 8, 8, 8], ["b"], nbytes=10)
    # b is a new conversation on disk: its system prompt is RAM's branch point, kept.
    assert disk.writes[-1] == (43, frozenset({40}))
    assert tuple(system) in disk.stored and tuple([*system, 8, 8, 8]) in disk.stored


@pytest.mark.parametrize("every", [1, 7])
def test_without_a_disk_nothing_changes(every: int) -> None:
    cache = PrefixCache(100, 4, copy=lambda s: list(s), offset=None, disk_every=every)
    assert cache.insert(_ids(5), ["x"], nbytes=1) and cache.flush_to_disk() == 0


def test_an_entry_ram_has_no_room_for_goes_to_disk() -> None:
    """Under memory pressure the RAM budget may be smaller than a snapshot: the disk
    gets it (as if evicted at once), so the conversation survives the pressure."""
    disk = RecordingDisk()
    cache = _cache(disk, max_bytes=5)
    assert not cache.insert(_ids(30), ["big"], nbytes=10)
    assert disk.writes == [(30, frozenset())] and cache.stats().rejected == 1
    assert not cache.insert([], ["empty"], nbytes=1) and len(disk.writes) == 1
