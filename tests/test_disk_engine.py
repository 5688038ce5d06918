"""The disk tier wired into the engine: greedy parity cold == RAM-warm == disk-warm for
every family, a restore followed by chunked prefill beside decoding rows, and damaged,
foreign or half-written files ending as misses with the cold run's tokens."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import collect, started_engine, tokens_of, wait_until

from mlxserve.config import EngineConfig
from mlxserve.engine.request import SamplingParams
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load

HISTORY = 160
MAX_TOKENS = 6


def _ids(seed: int, count: int, vocab: int = 120_000) -> list[int]:
    return [(seed * 7919 + i * 104_729) % vocab + 100 for i in range(count)]


def _config(disk: Path | None, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = {"max_prefill_tokens": 64, "prefix_cache_bytes": 1 << 30}
    if disk is not None:
        base["prefix_cache_dir"] = str(disk)
    base.update(kw)
    return EngineConfig(**base)


def _session(
    path: Path,
    config: EngineConfig,
    turns: list[list[int]],
    extra: int = 0,
    until: Callable[[dict[str, Any]], bool] | None = None,
):
    """Each prompt in turn (with `extra` unrelated requests beside the last);
    (tokens, cached tokens) per prompt, and the engine's stats (once `until` holds)."""

    async def main():
        engine = await started_engine(config, lambda: load(path))
        try:
            out = []
            params = SamplingParams(max_tokens=MAX_TOKENS)
            for i, prompt in enumerate(turns):
                others = [
                    collect(engine.submit(_ids(90 + k, 12), SamplingParams(max_tokens=24)))
                    for k in range(extra if i == len(turns) - 1 else 0)
                ]
                events, *_ = await asyncio.gather(collect(engine.submit(prompt, params)), *others)
                out.append((tokens_of(events), events[-1].cached_tokens))
            if until is not None:
                assert await asyncio.to_thread(wait_until, lambda: until(engine.stats()), 60)
            return out, engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def _cold(path: Path, prompt: list[int]) -> list[int]:
    """The oracle: a plain single-sequence greedy run (no engine, no cache reuse)."""
    return greedy_generate(load(path), prompt, MAX_TOKENS)


@pytest.fixture(params=["llama", "llama_swa", "qwen3", "deepseek_v4", "deepseek_v41"])
def family_dir(request, model_dir_factory, swa_model_dir) -> Path:
    if request.param == "llama_swa":
        return swa_model_dir
    return model_dir_factory(request.param)


def test_disk_warm_gives_the_cold_tokens_for_every_family(family_dir: Path, tmp_path) -> None:
    """RAM-warm == cold is `test_prefix_engine`'s; here the entry crosses a restart."""
    first = _ids(1, HISTORY)
    second = first + _ids(2, 9)
    disk = tmp_path / "disk"
    (turn_one,), _ = _session(family_dir, _config(disk), [first])
    assert turn_one[0] == _cold(family_dir, first)
    (restored,), stats = _session(family_dir, _config(disk), [second])
    assert restored[0] == _cold(family_dir, second)
    # The prompt's snapshot, or a trimmable `prompt + output` one cut back to it.
    assert restored[1] == HISTORY
    disk_stats = stats["prefix_cache_disk"]
    assert disk_stats["hits"] == 1 and disk_stats["restored_tokens"] == HISTORY
    assert stats["prefix_cache"]["hits"] == 1


def test_a_restore_then_a_long_chunked_suffix_beside_decoding_rows(
    model_dir_factory, tmp_path
) -> None:
    """The restored request prefills a long suffix in small chunks while other rows decode."""
    path = model_dir_factory("deepseek_v4")
    first = _ids(3, HISTORY)
    second = first + _ids(4, 150)
    disk = tmp_path / "disk"
    _session(path, _config(disk), [first])
    small = _config(disk, max_prefill_tokens=16, max_num_seqs=4)
    (restored,), stats = _session(path, small, [second], extra=2)
    assert restored == (_cold(path, second), HISTORY)
    assert stats["prefix_cache_disk"]["hits"] == 1


def _entry_files(disk: Path) -> list[Path]:
    return sorted(disk.glob("*/*.safetensors"))


def test_a_damaged_entry_is_a_miss_with_cold_tokens(model_dir_factory, tmp_path) -> None:
    path = model_dir_factory("qwen3")
    first, second = _ids(5, HISTORY), _ids(5, HISTORY) + _ids(6, 7)
    disk = tmp_path / "disk"
    _session(path, _config(disk), [first])
    for entry in _entry_files(disk):
        data = bytearray(entry.read_bytes())
        data[len(data) // 2 + 3] ^= 0x10
        entry.write_bytes(bytes(data))
    (got,), stats = _session(path, _config(disk), [second])
    assert got == (_cold(path, second), 0)
    assert stats["prefix_cache_disk"]["rejected_files"] >= 1
    assert stats["prefix_cache_disk"]["hits"] == 0


def test_another_models_entries_are_never_used(model_dir_factory, tmp_path) -> None:
    """Files written for another model (here another seed: same config, other weights)."""
    from mlxserve.cache.signature import model_signature

    mine, other = model_dir_factory("llama"), model_dir_factory("llama", seed=1)
    prompt = _ids(7, HISTORY) + _ids(8, 5)
    disk = tmp_path / "disk"
    _session(other, _config(disk), [_ids(7, HISTORY)])
    (theirs,) = disk.iterdir()
    # Their folder is theirs and stays: our signature names another one.
    model = load(mine)
    ours = disk / model_signature(mine, model.config, model.make_cache())[:16]
    assert ours != theirs
    # Copied into ours, each of their files is refused and removed: a miss.
    ours.mkdir()
    for entry in theirs.iterdir():
        shutil.copy(entry, ours / entry.name)
    (got,), stats = _session(mine, _config(disk), [prompt])
    assert got == (_cold(mine, prompt), 0)
    assert stats["prefix_cache_disk"]["rejected_files"] == len(list(theirs.iterdir()))
    assert stats["prefix_cache_disk"]["hits"] == 0 and list(theirs.iterdir())


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, threading
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from mlxserve.cache import copy_cache, disk_file
    from mlxserve.cache.disk_tier import DiskTier

    def stall(fd):  # the payload is in the temp file; the rename never comes
        print("writing", flush=True)
        threading.Event().wait()

    disk_file.os.fsync = stall
    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 1, 5, 4)), mx.ones((1, 1, 5, 4)))
    tier = DiskTier(sys.argv[1], 1 << 30, sys.argv[2])
    tier.write(list(range(1, 6)), copy_cache([cache]), ())
    tier.pump(flush=True)
    threading.Event().wait()
    """
)


def test_sigkill_while_an_entry_is_written_leaves_no_entry(model_dir_factory, tmp_path) -> None:
    from mlxserve.cache.disk_tier import DiskTier

    disk, signature = tmp_path / "disk", "3c" * 32
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(disk), signature],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "writing"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    folder = disk / signature[:16]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]
    tier = DiskTier(disk, 1 << 30, signature)
    try:
        assert tier.stats().entries == 0 and not list(folder.iterdir())
        assert tier.lookup(list(range(1, 9))) is None
    finally:
        tier.close()


def test_an_unusable_folder_still_serves_cold_tokens(model_dir_factory, tmp_path) -> None:
    path = model_dir_factory("llama")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    prompt = _ids(9, 40)
    (got,), stats = _session(path, _config(blocker), [prompt])
    assert got == (_cold(path, prompt), 0)
    assert stats["prefix_cache_disk"]["entries"] == 0


def test_a_restore_that_cannot_fit_the_budget_is_a_miss(model_dir_factory, tmp_path) -> None:
    path = model_dir_factory("llama")
    first = _ids(10, HISTORY)
    second = first + _ids(11, 5)
    disk = tmp_path / "disk"
    _session(path, _config(disk), [first])
    entry_bytes = sum(p.stat().st_size for p in _entry_files(disk))
    tight = _config(disk, prefix_cache_bytes=entry_bytes // 4)
    (got,), stats = _session(path, tight, [second])
    assert got == (_cold(path, second), 0)
    assert stats["prefix_cache_disk"]["hits"] == 0 and stats["prefix_cache_disk"]["misses"] == 1


def test_the_signature_tells_quantisations_and_layouts_apart(model_dir_factory) -> None:
    from mlx_lm.models.cache import RotatingKVCache

    from mlxserve.cache.signature import model_signature

    path = model_dir_factory("llama")
    model = load(path)
    base = model_signature(path, model.config, model.make_cache())
    assert base == model_signature(path, dict(model.config), model.make_cache())
    quantized = {**model.config, "quantization": {"group_size": 64, "bits": 4}}
    assert model_signature(path, quantized, model.make_cache()) != base
    windowed = [RotatingKVCache(max_size=8) for _ in model.make_cache()]
    assert model_signature(path, model.config, windowed) != base


def test_a_full_disk_drops_writes_and_serves_cold_tokens(
    model_dir_factory, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from mlxserve.cache import disk_tier

    def full(*_: Any, **__: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    path = model_dir_factory("llama")
    first, second = _ids(12, HISTORY), _ids(12, HISTORY) + _ids(13, 5)
    disk = tmp_path / "disk"
    with monkeypatch.context() as patch:
        patch.setattr(disk_tier, "write_entry", full)
        dropped = lambda stats: stats["prefix_cache_disk"]["dropped_writes"] >= 1  # noqa: E731
        (got,), _ = _session(path, _config(disk), [first], until=dropped)
    assert got[0] == _cold(path, first) and not _entry_files(disk)
    (got,), stats = _session(path, _config(disk), [second])
    assert got == (_cold(path, second), 0) and stats["prefix_cache_disk"]["hits"] == 0
