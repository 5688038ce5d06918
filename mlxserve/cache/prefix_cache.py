"""Prefix cache: a radix trie from token-id prefixes to cache snapshots, LRU in bytes.

Semantics (rules 3 and 4 of docs/architecture.md):

- An entry's key is exactly the tokens its snapshot holds.
- `lookup` returns the longest entry whose key is a *strict* prefix of the
  prompt, so at least the last prompt token is always fed to get logits, and
  `remaining` is exactly the tokens the returned cache does not hold.
- `insert` of a key supersedes every entry whose key is a prefix of it (and an
  identical key): a conversation that grows turn by turn keeps one entry. An
  entry at a branch point (a prefix that other stored keys also extend, such as
  a shared system prompt) is kept.
- The budget is bytes *and* entries; least recently used entries go first.
  After any insert, the held bytes never exceed `max_bytes`.

Only the engine's owner thread calls `lookup`/`insert`/`clear`; `stats()` may
be called from any thread (state changes and stats reads share a lock).

Keys are stored as packed int32 bytes on the edges of a compressed trie, so a
lookup is one walk over the prompt (C-speed `bytes.startswith` per edge) and a
30k-token key costs 120 KB, shared with every key it has a common prefix with.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mlxserve.cache.snapshot import (
    UnsupportedCacheError,
    cache_nbytes,
    is_trimmable,
    share_cache,
    tracked_offset,
    trim_cache,
    trim_step,
)
from mlxserve.cache.trie import TOKEN_BYTES, Node, Trie, pack, unpack

if TYPE_CHECKING:
    from mlxserve.cache.disk_tier import DiskTier

__all__ = ["PrefixCache", "PrefixCacheStats", "PrefixHit"]

# Tokens an entry grows by before it is written to disk again (one agent turn
# does not rewrite a long conversation's cache; eviction and shutdown write it).
DEFAULT_DISK_EVERY = 4096


@dataclass(frozen=True)
class PrefixHit:
    """A reusable cache for the first `key_len` prompt tokens."""

    key_len: int
    cache: list[Any]  # the caller's own cache objects: it may write into them
    remaining: list[int]  # prompt_ids[key_len:], never empty
    taken: bool = False  # the entry itself was handed over (and left the cache)


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int
    misses: int
    tokens_reused: int
    bytes: int
    entries: int
    evictions: int  # removed to fit the byte or entry budget
    superseded: int  # removed because a longer (or identical) key replaced them
    inserts: int  # entries stored (rejected inserts are not counted)
    rejected: int  # inserts not stored (larger than the whole budget, or empty key)
    taken: int = 0  # hits that took their entry over instead of sharing it


class PrefixCacheObserver(Protocol):
    """Told of every decision, in order (distributed serving replays them on the other
    ranks, which hold their own shard of each entry: `engine/distributed.py`)."""

    def stored(self, entry_id: int, key: bytes) -> None: ...

    def dropped(self, entry_id: int) -> None: ...

    def hit(self, entry_id: int, reused: int, taken: bool, cache: list[Any]) -> None: ...


@dataclass
class _Entry:
    snapshot: list[Any]
    nbytes: int
    key_len: int
    trimmable: bool = False
    trim_step: int = 1  # trimmed back only to multiples of this (`snapshot.trim_step`)
    dirty: bool = False  # grown past its last disk write by less than `disk_every`
    entry_id: int = 0


# A RAM entry leaving for the disk tier: its key, snapshot, and the lengths of
# the shorter entries the RAM cache still holds on its path (they stay on disk).
_Write = tuple[list[int], list[Any], list[int]]


class PrefixCache:
    """Token-prefix -> cache-snapshot store with an LRU byte and entry budget.

    `copy` makes the cache objects a hit hands out (default: `share_cache`,
    new objects over the snapshot's immutable buffers, so a hit copies nothing).
    `offset` reads how many tokens a snapshot holds, to check it against its
    key on insert (default: `tracked_offset`; None skips the check, e.g. for
    opaque test snapshots).
    """

    def __init__(
        self,
        max_bytes: int,
        max_entries: int,
        *,
        copy: Callable[[list[Any]], list[Any]] = share_cache,
        offset: Callable[[list[Any]], int | None] | None = tracked_offset,
        trimmable: Callable[[list[Any]], bool] = is_trimmable,
        disk: DiskTier | None = None,
        disk_every: int = DEFAULT_DISK_EVERY,
    ) -> None:
        if max_bytes < 0 or max_entries < 0:
            raise ValueError("max_bytes and max_entries must be >= 0")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._copy = copy
        self._offset = offset
        self._trimmable = trimmable
        self._lock = threading.Lock()
        self._trie = Trie()
        self._lru: OrderedDict[Node, _Entry] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._tokens_reused = 0
        self._evictions = self._superseded = self._inserts = self._rejected = 0
        self._taken = 0
        self.disk = disk
        self.disk_every = disk_every
        self.observer: PrefixCacheObserver | None = None
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def peek(self, prompt_ids: Sequence[int]) -> int:
        """The key length of the longest strict-prefix entry (0 for none), without side effects."""
        with self._lock:
            node = self._trie.longest_strict_prefix(pack(prompt_ids))
            return 0 if node is None or node.entry is None else node.entry.key_len

    def reusable(self, prompt_ids: Sequence[int]) -> int:
        """How many prompt tokens `lookup` would reuse (0 for none), without side effects."""
        with self._lock:
            return self._trie.best_reuse(pack(prompt_ids))[1]

    def shared_prefix_len(self, prompt_ids: Sequence[int]) -> int:
        """Tokens the prompt shares with the longest-matching stored key (no side effects).

        The engine snapshots a prompt there too, so that the next conversation
        that shares this prefix (a system prompt, tool definitions) hits it.
        """
        with self._lock:
            return self._trie.shared_bytes(pack(prompt_ids)) // TOKEN_BYTES

    def lookup(self, prompt_ids: Sequence[int], take: bool = False) -> PrefixHit | None:
        """The longest reusable prefix of the prompt, as cache objects of the caller's own.

        Normally the longest entry whose key is a strict prefix of the prompt.
        A trimmable entry (plain KV) that shares more of the prompt than that,
        e.g. a `prompt + output` entry whose reply was re-rendered differently,
        is handed out trimmed back to the shared part instead.

        `take`: the caller will insert a snapshot that extends this prompt, which
        supersedes the entry unless other keys branch from it. Such an entry (a
        leaf, used whole) is handed over and leaves the cache: nothing is copied
        and its bytes are not held twice. Other hits share the snapshot's buffers.
        """
        key = pack(prompt_ids)
        with self._lock:
            node, reused = self._trie.best_reuse(key)
            if node is None or node.entry is None:
                self._misses += 1
                return None
            chosen = node.entry
            self._hits += 1
            self._tokens_reused += reused
            taken = take and not node.children and reused == chosen.key_len
            if taken:
                self._taken += 1
                if self.observer is not None:
                    self.observer.hit(chosen.entry_id, reused, True, chosen.snapshot)
                self._drop(node)
            else:
                self._lru.move_to_end(node)
        if taken:
            return PrefixHit(reused, chosen.snapshot, list(prompt_ids[reused:]), taken=True)
        # A stored snapshot is never written to, so sharing it needs no lock.
        cache = self._copy(chosen.snapshot)
        if reused < chosen.key_len:
            trim_cache(cache, chosen.key_len - reused)
        if self.observer is not None:
            self.observer.hit(chosen.entry_id, reused, False, cache)
        return PrefixHit(reused, cache, list(prompt_ids[reused:]))

    def insert(
        self, key_ids: Sequence[int], snapshot: list[Any], nbytes: int | None = None
    ) -> bool:
        """Store `snapshot` (holding exactly `key_ids`); True if it was stored.

        The caller passes a snapshot it will not write to again, normally
        `copy_cache(live_cache, wait=False)` taken when the cache covered exactly `key_ids`;
        it is stored as is, not copied. `nbytes` defaults to `cache_nbytes`.
        An entry larger than `max_bytes` (or an empty key) is not stored and
        leaves the cache unchanged; with a disk tier it goes to disk, as if
        evicted at once.
        """
        size, trimmable, step = self._measure(key_ids, snapshot, nbytes)
        key = pack(key_ids)
        entry: _Entry | None = None
        writes: list[_Write] = []
        with self._lock:
            if key and size <= self.max_bytes and self.max_entries > 0:
                node, entry = self._store(key, snapshot, size, trimmable, step)
            else:
                self._rejected += 1
            # Shorter entries of this key that RAM holds (before evicting for room):
            # they stay on disk when this one is written.
            ram_prefixes = self._held_prefixes(key)
            if entry is not None:
                writes = self._evict_to_fit()
            stored_now = entry is not None and node.entry is entry  # not evicted at once
        if self.disk is None:
            return entry is not None
        if entry is None:
            if key:
                self._write([(list(key_ids), snapshot, ram_prefixes)])
            return False
        if stored_now:
            self._write_behind(list(key_ids), entry, ram_prefixes)
        self._write(writes)
        return True

    def _measure(
        self, key_ids: Sequence[int], snapshot: list[Any], nbytes: int | None
    ) -> tuple[int, bool, int]:
        """A snapshot's bytes, whether it can be trimmed and to multiples of what
        (`snapshot.trim_step`), checked against its key."""
        if self._offset is not None:
            held = self._offset(snapshot)
            if held is not None and held != len(key_ids):
                raise ValueError(f"snapshot holds {held} tokens but its key has {len(key_ids)}")
        size = cache_nbytes(snapshot) if nbytes is None else nbytes
        if size < 0:
            raise ValueError("nbytes must be >= 0")
        try:
            trimmable = self._trimmable(snapshot)
            step = trim_step(snapshot) if trimmable else 1
        except UnsupportedCacheError:  # opaque snapshots (tests) are never trimmed
            trimmable, step = False, 1
        return size, trimmable, step

    def _store(
        self, key: bytes, snapshot: list[Any], size: int, trimmable: bool, step: int
    ) -> tuple[Node, _Entry]:
        """Put a new entry at `key` (under the lock): it replaces an entry with the
        same key and supersedes those on its strict prefixes, except branch points
        that other keys still extend."""
        node, prefixes = self._trie.node_for(key)
        if node.entry is not None:
            replaced = self._lru.pop(node)
            self._bytes -= replaced.nbytes
            self._superseded += 1
            if self.observer is not None:
                self.observer.dropped(replaced.entry_id)
        for old in prefixes:  # removing an ancestor never detaches `node`
            if len(old.children) > 1:
                continue
            self._drop(old)
            self._superseded += 1
        self._next_id += 1
        entry = _Entry(
            snapshot, size, len(key) // TOKEN_BYTES, trimmable, step, entry_id=self._next_id
        )
        node.entry = entry
        if self.observer is not None:
            self.observer.stored(entry.entry_id, key)
        self._lru[node] = entry
        self._bytes += size
        self._inserts += 1
        return node, entry

    def _write_behind(self, key_ids: list[int], entry: _Entry, kept: list[int]) -> None:
        """Write a new entry to disk when it is new there or has grown by `disk_every`
        tokens since its last write; otherwise it is written when it leaves RAM."""
        assert self.disk is not None
        recorded = [n for n in self.disk.recorded_lengths(key_ids) if n not in kept]
        last = max(recorded, default=0)
        if last == len(key_ids):
            return  # stored already (e.g. it came from the disk)
        if last and len(key_ids) - last < self.disk_every:
            entry.dirty = True
            return
        self.disk.write(key_ids, entry.snapshot, kept)

    def _write(self, writes: list[_Write]) -> None:
        if self.disk is not None:
            for key_ids, snapshot, kept in writes:
                self.disk.write(key_ids, snapshot, kept)

    def _evict_to_fit(self) -> list[_Write]:
        """Evict LRU entries past the byte or entry budget (under the lock); dirty
        ones are returned, to be written to disk before they are gone."""
        writes: list[_Write] = []
        while self._lru and (self._bytes > self.max_bytes or len(self._lru) > self.max_entries):
            node = next(iter(self._lru))
            if node.entry.dirty and self.disk is not None:
                writes.append(self._pending_write(node))
            self._drop(node)
            self._evictions += 1
        return writes

    def _pending_write(self, node: Node) -> _Write:
        key = self._trie.key_of(node)
        return unpack(key), node.entry.snapshot, self._held_prefixes(key)

    def _held_prefixes(self, key: bytes) -> list[int]:
        """Lengths of the entries RAM holds on strict prefixes of `key` (under the lock):
        they stay on disk when an entry for `key` is written."""
        tokens = len(key) // TOKEN_BYTES
        found = (n.entry.key_len for n in self._trie.path_nodes(key) if n.entry is not None)
        return [length for length in found if length < tokens]

    def flush_to_disk(self) -> int:
        """Write every entry that is not on disk yet (at shutdown); returns how many."""
        if self.disk is None:
            return 0
        with self._lock:
            writes = [self._pending_write(node) for node, e in self._lru.items() if e.dirty]
            for entry in self._lru.values():
                entry.dirty = False
        self._write(writes)
        return len(writes)

    def set_limit(self, max_bytes: int) -> int:
        """Change the byte budget, evicting LRU entries to fit; returns the bytes freed.

        The engine shrinks the prefix cache this way before running caches
        would push the shared KV budget over (rule 9 of docs/architecture.md).
        """
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        with self._lock:
            self.max_bytes = max_bytes
            before = self._bytes
            writes = self._evict_to_fit()
            freed = before - self._bytes
        self._write(writes)
        return freed

    def _drop(self, node: Node) -> None:
        entry = self._lru.pop(node)
        self._bytes -= entry.nbytes
        self._trie.remove(node)
        if self.observer is not None:
            self.observer.dropped(entry.entry_id)

    def clear(self) -> None:
        """Drop every entry (the hit/miss/eviction counters are kept)."""
        with self._lock:
            if self.observer is not None:
                for entry in self._lru.values():
                    self.observer.dropped(entry.entry_id)
            self._trie = Trie()
            self._lru.clear()
            self._bytes = 0

    def stats(self) -> PrefixCacheStats:
        """A consistent snapshot of the counters; safe from any thread."""
        with self._lock:
            return PrefixCacheStats(
                hits=self._hits,
                misses=self._misses,
                tokens_reused=self._tokens_reused,
                bytes=self._bytes,
                entries=len(self._lru),
                evictions=self._evictions,
                superseded=self._superseded,
                inserts=self._inserts,
                rejected=self._rejected,
                taken=self._taken,
            )
