"""The prefix cache's disk tier: an index of entry files, a writer and a reader thread.

The prefix cache decides what to write and when (`prefix_cache.py`); this
module keeps the files. Its index is a trie of the stored keys with an LRU
byte budget (`--prefix-cache-disk-bytes`), rebuilt from the files' manifests
at start (files that fail a check are removed and counted as rejected).

Threads (rules 1 and 10 of docs/architecture.md): `write`, `pump`, `lookup` and `load` are
called on the engine's owner thread. `pump` takes each staged snapshot apart
into evaluated arrays and `memoryview`s over them; only those views reach the
writer thread, which serialises, checksums, fsyncs and renames without calling
MLX, then tells the owner thread which arrays it may let go. Reads and their
checks run on a reader thread; the owner thread turns the bytes into arrays
(`codec.Restore`). A full or slow disk drops writes (counted), never a step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxserve.cache.codec import encode
from mlxserve.cache.disk_file import (
    SUFFIX,
    TEMP_PREFIX,
    CorruptEntry,
    Manifest,
    Tensor,
    read_entry,
    read_manifest,
    write_entry,
)
from mlxserve.cache.layers import layout_trim_step, layout_trimmable
from mlxserve.cache.trie import Node, Trie, pack

__all__ = ["DiskEntry", "DiskLoad", "DiskTier", "DiskTierStats"]

logger = logging.getLogger(__name__)

# Snapshot bytes waiting for the writer beyond which new writes are dropped.
DEFAULT_BACKLOG_BYTES = 2 * 1024**3


@dataclass
class DiskEntry:
    name: str
    key_len: int
    nbytes: int = 0
    committed: bool = False
    trimmable: bool = False  # plain KV: a longer entry can be cut back to a shared prefix
    trim_step: int = 1  # ... to a multiple of this many tokens (`layers.layout_trim_step`)


@dataclass(frozen=True)
class DiskLoad:
    """An entry read back and checked: its tokens, cache layout and tensors."""

    tokens: list[int]
    layout: list[dict[str, Any]]
    tensors: dict[str, Tensor]


@dataclass(frozen=True)
class DiskTierStats:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    restored_tokens: int
    restore_s: float  # total time from lookup to a restored cache
    last_restore_s: float
    writes: int
    written_bytes: int
    write_backlog: int
    write_backlog_bytes: int
    dropped_writes: int
    rejected_files: int
    evictions: int
    superseded: int


@dataclass
class _Staged:
    key_ids: list[int]
    snapshot: list[Any] | None  # dropped once encoded
    keep: frozenset[int]
    node: Node
    entry: DiskEntry


@dataclass
class _Job:
    number: int
    staged: _Staged
    layout: list[dict[str, Any]]
    tensors: list[Tensor]
    nbytes: int


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    restore_s: float = 0.0
    last_restore_s: float = 0.0
    writes: int = 0
    written_bytes: int = 0
    dropped_writes: int = 0
    rejected_files: int = 0
    evictions: int = 0
    superseded: int = 0
    backlog: int = 0
    backlog_bytes: int = 0


def _committed(entry: DiskEntry) -> bool:
    return entry.committed


def entry_name(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:40] + SUFFIX


class DiskTier:
    """Entry files under `directory/<signature prefix>/`, bounded by `max_bytes`."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        signature: str,
        backlog_bytes: int = DEFAULT_BACKLOG_BYTES,
    ) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.folder = Path(directory) / signature[:16]
        self.max_bytes = max_bytes
        self.signature = signature
        self.backlog_limit = backlog_bytes
        self._lock = threading.Lock()
        self._trie = Trie()
        self._lru: OrderedDict[Node, DiskEntry] = OrderedDict()
        self._bytes = 0
        self._counters = _Counters()
        self._staged: list[_Staged] = []
        self._ready: list[_Staged] = []
        self._jobs = 0
        self._in_flight: dict[int, list[Any]] = {}  # job number -> arrays it reads
        self._done: list[int] = []
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mlxserve-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mlxserve-disk-read")
        self._closed = False
        self._rebuild()

    # -- index (under the lock) ----------------------------------------------
    def _rebuild(self) -> None:
        """Index the folder's files; remove temp files and files that fail a check."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            paths = list(self.folder.iterdir())
        except OSError as e:
            logger.error(
                "prefix-cache disk tier: cannot use %s (%s); writes will be dropped", self.folder, e
            )
            return
        found: list[tuple[float, Manifest, Path]] = []
        for path in paths:
            if path.name.startswith(TEMP_PREFIX):
                self._remove_file(path, "a half-written temp file")
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                manifest = read_manifest(path)
                mtime = path.stat().st_mtime
            except (CorruptEntry, OSError) as e:
                self._reject(path, str(e))
                continue
            if manifest.signature != self.signature:
                self._reject(path, "another model's signature")
            elif path.name != entry_name(pack(manifest.tokens)):
                self._reject(path, "its name does not match its tokens")
            else:
                found.append((mtime, manifest, path))
        with self._lock:
            for _, manifest, path in sorted(found, key=lambda item: item[0]):
                node, _ = self._trie.node_for(pack(manifest.tokens))
                entry = DiskEntry(
                    path.name,
                    len(manifest.tokens),
                    manifest.file_bytes,
                    committed=True,
                    trimmable=layout_trimmable(manifest.layout),
                    trim_step=layout_trim_step(manifest.layout),
                )
                node.entry = entry
                self._lru[node] = entry
                self._bytes += entry.nbytes
            victims = self._evict_over_budget()
        self._delete(victims)
        logger.info(
            "prefix-cache disk tier: %d entries, %d bytes in %s",
            len(self._lru),
            self._bytes,
            self.folder,
        )

    def _reject(self, path: Path, reason: str) -> None:
        with self._lock:
            self._counters.rejected_files += 1
        self._remove_file(path, reason)

    def _remove_file(self, path: Path, reason: str) -> None:
        logger.warning("prefix-cache disk tier: removing %s: %s", path.name, reason)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("prefix-cache disk tier: could not remove %s: %s", path.name, e)

    def _drop(self, node: Node) -> DiskEntry:
        entry = node.entry
        assert entry is not None
        if self._lru.pop(node, None) is not None:
            self._bytes -= entry.nbytes
        self._trie.remove(node)
        return entry

    def _evict_over_budget(self, spare: Node | None = None) -> list[str]:
        victims = []
        for node in list(self._lru):
            if self._bytes <= self.max_bytes:
                break
            if node is not spare:
                victims.append(self._drop(node).name)
                self._counters.evictions += 1
        return victims

    def _delete(self, names: Collection[str]) -> None:
        for name in names:
            try:
                (self.folder / name).unlink(missing_ok=True)
            except OSError as e:
                logger.warning("prefix-cache disk tier: could not remove %s: %s", name, e)

    # -- the owner thread --------------------------------------------------
    def recorded_lengths(self, key_ids: Sequence[int]) -> list[int]:
        """Lengths of the entries stored or queued on `key_ids`' path (itself included)."""
        with self._lock:
            return [n.entry.key_len for n in self._trie.path_nodes(pack(key_ids)) if n.entry]

    def write(self, key_ids: Sequence[int], snapshot: list[Any], keep: Collection[int]) -> None:
        """Queue a snapshot for writing; `keep`: lengths of prefixes that stay on disk
        (entries the prefix cache still holds apart). Others on its path are replaced."""
        if self._closed:
            return
        key = pack(key_ids)
        with self._lock:
            node, _ = self._trie.node_for(key)
            if node.entry is not None:
                return  # the same tokens are stored or queued already
            entry = DiskEntry(entry_name(key), len(key_ids))
            node.entry = entry
        self._staged.append(_Staged(list(key_ids), snapshot, frozenset(keep), node, entry))

    def pump(self, flush: bool = False) -> None:
        """Hand staged snapshots to the writer: those staged before the last pump (their
        copies have been computed since), or all of them with `flush`."""
        with self._lock:
            done, self._done = self._done, []
        for number in done:
            self._in_flight.pop(number, None)
        batch = self._ready + self._staged if flush else self._ready
        self._ready, self._staged = ([], []) if flush else (self._staged, [])
        for staged in batch:
            self._submit(staged)

    def _submit(self, staged: _Staged) -> None:
        snapshot, staged.snapshot = staged.snapshot, None
        try:
            encoded = encode(snapshot or [])
        except Exception:  # an unstorable snapshot (or no memory to read it) loses its write
            logger.exception("prefix-cache disk tier: cannot store this snapshot")
            with self._lock:
                self._counters.dropped_writes += 1
                self._forget(staged.node, staged.entry)
            return
        nbytes = sum(t.data.nbytes for t in encoded.tensors if isinstance(t.data, memoryview))
        with self._lock:
            if self._counters.backlog_bytes + nbytes > self.backlog_limit:
                self._counters.dropped_writes += 1
                self._forget(staged.node, staged.entry)
                logger.warning("prefix-cache disk tier: writer backlog full; dropping a write")
                return
            self._counters.backlog += 1
            self._counters.backlog_bytes += nbytes
            self._jobs += 1
            number = self._jobs
        self._in_flight[number] = encoded.arrays
        job = _Job(number, staged, encoded.layout, encoded.tensors, nbytes)
        self._writer.submit(self._write_job, job)

    def _forget(self, node: Node, entry: DiskEntry) -> None:
        """Take a queued (uncommitted) entry out of the index (under the lock)."""
        if node.entry is entry and not entry.committed:
            self._trie.remove(node)

    def lookup(self, prompt_ids: Sequence[int]) -> tuple[DiskEntry, int] | None:
        """The stored entry that reuses most of the prompt, and how many of its tokens
        (as the RAM cache chooses: see `Trie.best_reuse`)."""
        with self._lock:
            node, reused = self._trie.best_reuse(pack(prompt_ids), accept=_committed)
            return None if node is None else (node.entry, reused)

    def load(self, entry: DiskEntry) -> Future[DiskLoad | None]:
        """Read and check an entry on the reader thread (None: it was not usable)."""
        return self._reader.submit(self._read_job, entry)

    def restored(self, tokens: int, seconds: float) -> None:
        with self._lock:
            c = self._counters
            c.hits += 1
            c.restored_tokens += tokens
            c.restore_s += seconds
            c.last_restore_s = seconds

    def missed(self) -> None:
        with self._lock:
            self._counters.misses += 1

    def close(self, timeout: float = 60.0) -> None:
        """Write what is staged, wait (up to `timeout`) for the writer, stop the threads."""
        if self._closed:
            return
        self.pump(flush=True)
        self._closed = True
        deadline = time.monotonic() + timeout
        drained = self._writer.submit(lambda: None)
        try:
            drained.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            logger.warning(
                "prefix-cache disk tier: %d writes left unfinished at shutdown",
                self._counters.backlog,
            )
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)

    # -- the writer and reader threads (no MLX) -------------------------------
    def _write_job(self, job: _Job) -> None:
        staged = job.staged
        try:
            size = write_entry(
                self.folder / staged.entry.name,
                self.signature,
                staged.key_ids,
                job.layout,
                job.tensors,
            )
        except OSError as e:  # a full, read-only or failing disk drops the write
            logger.warning(
                "prefix-cache disk tier: write of %d tokens dropped: %s", staged.entry.key_len, e
            )
            with self._lock:
                self._counters.dropped_writes += 1
                self._forget(staged.node, staged.entry)
            return
        finally:
            for tensor in job.tensors:
                if isinstance(tensor.data, memoryview):
                    tensor.data.release()
            with self._lock:
                self._counters.backlog -= 1
                self._counters.backlog_bytes -= job.nbytes
                self._done.append(job.number)
        trimming = layout_trimmable(job.layout), layout_trim_step(job.layout)
        self._delete(self._commit(staged, size, trimming))

    def _commit(self, staged: _Staged, size: int, trimming: tuple[bool, int]) -> list[str]:
        """Index a written entry; returns the files it replaced or evicted."""
        node, entry = staged.node, staged.entry
        with self._lock:
            self._counters.writes += 1
            self._counters.written_bytes += size
            if node.entry is not entry:
                return [entry.name]  # forgotten meanwhile (cannot happen today): no orphan
            entry.committed, entry.nbytes = True, size
            entry.trimmable, entry.trim_step = trimming
            self._lru[node] = entry
            self._bytes += size
            victims = []
            for prefix in self._trie.path_nodes(pack(staged.key_ids))[:-1]:
                old = prefix.entry
                if old is None or not old.committed or old.key_len in staged.keep:
                    continue
                if len(prefix.children) > 1:
                    continue  # a branch point other stored keys extend
                victims.append(self._drop(prefix).name)
                self._counters.superseded += 1
            victims += self._evict_over_budget(spare=node if size <= self.max_bytes else None)
        return victims

    def _read_job(self, entry: DiskEntry) -> DiskLoad | None:
        path = self.folder / entry.name
        try:
            manifest, tensors = read_entry(path)
            if manifest.signature != self.signature:
                raise CorruptEntry("another model's signature")
            if len(manifest.tokens) != entry.key_len:
                raise CorruptEntry("its tokens differ from the index")
        except CorruptEntry as e:
            self._discard(entry)
            self._reject(path, str(e))
            return None
        except OSError as e:
            logger.warning("prefix-cache disk tier: cannot read %s: %s", entry.name, e)
            self._discard(entry)
            return None
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError as e:
            logger.debug("prefix-cache disk tier: cannot touch %s: %s", entry.name, e)
        with self._lock:
            node = self._node_of(manifest.tokens, entry)
            if node is not None:
                self._lru.move_to_end(node)
        return DiskLoad(manifest.tokens, manifest.layout, tensors)

    def _node_of(self, tokens: list[int], entry: DiskEntry) -> Node | None:
        path = self._trie.path_nodes(pack(tokens))
        if path and path[-1].entry is entry:
            return path[-1]
        return None

    def _discard(self, entry: DiskEntry) -> None:
        """Drop an entry found unusable from the index (its file is handled apart)."""
        with self._lock:
            for node in list(self._lru):
                if node.entry is entry:
                    self._drop(node)
                    return

    def stats(self) -> DiskTierStats:
        with self._lock:
            c = self._counters
            return DiskTierStats(
                entries=len(self._lru),
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                hits=c.hits,
                misses=c.misses,
                restored_tokens=c.restored_tokens,
                restore_s=c.restore_s,
                last_restore_s=c.last_restore_s,
                writes=c.writes,
                written_bytes=c.written_bytes,
                write_backlog=c.backlog,
                write_backlog_bytes=c.backlog_bytes,
                dropped_writes=c.dropped_writes,
                rejected_files=c.rejected_files,
                evictions=c.evictions,
                superseded=c.superseded,
            )
