"""The disk tier's index and threads: write-behind, supersede, LRU on disk, the index
rebuilt at start, damaged or foreign files rejected, failing disks dropping writes,
and a writer thread that never calls into MLX."""

from __future__ import annotations

import errno
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_helpers import wait_until
from test_cache_snapshot import feed, llama_forward, llama_model

from mlxserve.cache import copy_cache
from mlxserve.cache import disk_tier as disk_tier_module
from mlxserve.cache.disk_tier import DiskTier

SIGNATURE = "5a" * 32
WAIT_S = 30.0


def _snapshot(tokens: list[int]) -> list[Any]:
    live = llama_model().make_cache()
    feed(llama_forward, live, [tokens])
    return copy_cache(live)


def _key(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 7) % 200 + 1 for i in range(n)]


def _write(tier: DiskTier, key: list[int], keep: tuple[int, ...] = ()) -> None:
    before = tier.stats().writes + tier.stats().dropped_writes
    tier.write(key, _snapshot(key), keep)
    tier.pump(flush=True)
    assert wait_until(lambda: tier.stats().writes + tier.stats().dropped_writes > before, WAIT_S)


def _files(tier: DiskTier) -> list[str]:
    return sorted(p.name for p in tier.folder.iterdir())


@pytest.fixture
def tier(tmp_path: Path):
    t = DiskTier(tmp_path, 1 << 30, SIGNATURE)
    yield t
    t.close()


def test_a_written_entry_is_found_by_a_longer_prompt(tier: DiskTier) -> None:
    key = _key(20)
    _write(tier, key)
    stats = tier.stats()
    assert stats.writes == 1 and stats.entries == 1 and stats.bytes > 0
    assert len(_files(tier)) == 1
    found = tier.lookup(key + [5])
    assert found is not None and found[1] == 20
    assert tier.lookup(key) is None or tier.lookup(key)[1] < 20  # strict prefixes only
    assert tier.recorded_lengths(key + [5, 6]) == [20]


def test_an_entry_replaces_its_parent_on_disk_unless_kept(tier: DiskTier) -> None:
    short, longer, longest = _key(10), _key(16), _key(24)
    _write(tier, short)
    _write(tier, longer)
    assert tier.stats().superseded == 1 and tier.stats().entries == 1
    assert tier.lookup(longer + [1])[0].key_len == 16
    _write(tier, longest, keep=(16,))  # the RAM cache still holds 16 apart: it stays
    assert tier.stats().entries == 2
    assert sorted(tier.recorded_lengths(longest)) == [16, 24]


def test_lru_eviction_keeps_the_disk_within_its_budget(tmp_path: Path) -> None:
    probe = DiskTier(tmp_path / "probe", 1 << 30, SIGNATURE)
    _write(probe, _key(12, seed=1))
    one = probe.stats().bytes
    probe.close()
    tier = DiskTier(tmp_path, 2 * one + one // 2, SIGNATURE)
    try:
        keys = [_key(12, seed=s) for s in (2, 3, 4)]
        _write(tier, keys[0])
        _write(tier, keys[1])
        # A restore touches the first entry, so the second is the oldest now.
        found = tier.lookup(keys[0] + [9])
        assert found is not None and tier.load(found[0]).result(WAIT_S) is not None
        _write(tier, keys[2])
        stats = tier.stats()
        assert stats.evictions == 1 and stats.entries == 2 and stats.bytes <= tier.max_bytes
        assert tier.lookup(keys[1] + [9]) is None
        assert tier.lookup(keys[0] + [9]) is not None
    finally:
        tier.close()


def test_the_index_is_rebuilt_at_start_and_bad_files_are_removed(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 1 << 30, SIGNATURE)
    for seed in (5, 6, 7):
        _write(first, _key(14, seed=seed))
    first.close()
    folder = first.folder
    # A half-written temp file, a renamed entry, a truncated entry, another model's entry.
    (folder / ".tmp-abc.safetensors.123").write_bytes(b"partial")
    renamed, truncated, _ = sorted(folder.glob("*.safetensors"))
    renamed.rename(folder / ("0" * 40 + ".safetensors"))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    foreign = DiskTier(tmp_path / "foreign", 1 << 30, "77" * 32)
    _write(foreign, _key(9, seed=8))
    foreign.close()
    for path in foreign.folder.iterdir():
        shutil.copy(path, folder / path.name)

    second = DiskTier(tmp_path, 1 << 30, SIGNATURE)
    try:
        stats = second.stats()
        assert stats.entries == 1
        assert stats.rejected_files == 3  # renamed, truncated, foreign
        assert len(_files(second)) == 1  # the temp file is gone too
    finally:
        second.close()


def test_a_flipped_byte_is_a_miss_and_the_file_is_removed(tier: DiskTier) -> None:
    key = _key(18)
    _write(tier, key)
    (path,) = tier.folder.iterdir()
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40
    path.write_bytes(bytes(data))
    found = tier.lookup(key + [3])
    assert found is not None
    assert tier.load(found[0]).result(WAIT_S) is None
    assert tier.stats().rejected_files == 1 and tier.stats().entries == 0
    assert not path.exists()
    assert tier.lookup(key + [3]) is None


def test_an_unusable_folder_drops_writes(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    tier = DiskTier(blocker, 1 << 30, SIGNATURE)
    try:
        _write(tier, _key(10))
        stats = tier.stats()
        assert stats.dropped_writes == 1 and stats.writes == 0 and stats.entries == 0
        assert tier.lookup(_key(10) + [1]) is None
    finally:
        tier.close()


def test_a_full_disk_drops_the_write(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: Any, **__: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier_module, "write_entry", full)
    _write(tier, _key(10))
    assert tier.stats().dropped_writes == 1 and tier.stats().entries == 0
    assert tier.recorded_lengths(_key(10)) == []  # it will be written again later


def test_a_full_backlog_drops_writes_without_waiting(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, SIGNATURE, backlog_bytes=1)
    try:
        tier.write(_key(10), _snapshot(_key(10)), ())
        tier.pump(flush=True)
        assert tier.stats().dropped_writes == 1 and tier.stats().write_backlog == 0
    finally:
        tier.close()


def test_the_writer_thread_never_calls_into_mlx(tmp_path: Path) -> None:
    """Every C function the disk threads call is recorded: none belongs to MLX."""
    calls: list[str] = []
    lock = threading.Lock()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "c_call" or not threading.current_thread().name.startswith("mlxserve-disk"):
            return
        module = getattr(arg, "__module__", None) or ""
        owner = type(getattr(arg, "__self__", None)).__module__
        with lock:
            calls.append(f"{module}:{owner}:{getattr(arg, '__qualname__', arg)}")

    threading.setprofile(profile)
    try:
        tier = DiskTier(tmp_path, 1 << 30, SIGNATURE)
        key = _key(20)
        _write(tier, key)
        found = tier.lookup(key + [1])
        assert found is not None and tier.load(found[0]).result(WAIT_S) is not None
        tier.close()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert calls, "the profile hook saw the disk threads"
    assert not [c for c in calls if "mlx" in c], [c for c in calls if "mlx" in c]
    assert "mlx.core" in sys.modules and mx.default_device() is not None
