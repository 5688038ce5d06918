"""Bringing a prefix-cache entry back from the disk tier for a waiting request.

When the RAM prefix cache has nothing as long as the disk has for a request
at the head of the queue, the request steps aside while the reader thread
reads and checks the file. The runner then turns the bytes into arrays a
slice per step (`DiskRestore`, so other streams keep decoding), the entry goes
into the RAM prefix cache like any snapshot, and the request goes back to the
head of the queue, where admission finds it as an ordinary RAM hit. A restore
that fails, or that the RAM cache cannot hold, is a miss: the request goes on
as it would have without the disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxserve.engine.request import Request

if TYPE_CHECKING:
    from mlxserve.cache.disk_tier import DiskLoad, DiskTier
    from mlxserve.cache.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

# Bytes of a restored entry turned into arrays per step (a memory copy: on
# Metal a few milliseconds, so decoding streams barely notice).
RESTORE_BYTES_PER_STEP = 256 * 1024 * 1024


@dataclass
class DiskRestore:
    """An entry read from disk that the runner turns into a cache across steps."""

    request_id: str
    key_ids: list[int]
    restore: Any  # cache.codec.Restore
    max_bytes: int = RESTORE_BYTES_PER_STEP
    cache: list[Any] | None = None  # set by the runner once every array is made
    error: str | None = None


@dataclass
class _Pending:
    request: Request
    load: Future[DiskLoad | None]
    started: float
    reuse: int  # prompt tokens the entry serves (a trimmable one may hold more)
    job: DiskRestore | None = None


class Restorer:
    """The requests whose prefix is being read back from disk (engine thread only)."""

    def __init__(
        self, disk: DiskTier, prefix_cache: PrefixCache, wake: Callable[[], None] | None = None
    ) -> None:
        self.disk = disk
        self.prefix_cache = prefix_cache
        self._wake = wake
        self.pending: dict[str, _Pending] = {}
        self._checked: set[str] = set()

    def start(self, request: Request) -> bool:
        """Start reading the disk's entry for `request` if it beats the RAM cache.

        True: the request waits here until `finish` hands it back. Each request
        looks at the disk once.
        """
        rid = request.request_id
        if rid in self._checked:
            return False
        self._checked.add(rid)
        context = request.context_ids
        found = self.disk.lookup(context)
        ram = self.prefix_cache.reusable(context)
        if found is None or found[1] <= ram:
            if found is None and ram == 0:
                self.disk.missed()
            return False
        entry, reuse = found
        if entry.nbytes > self.prefix_cache.max_bytes:
            logger.info("disk entry of %d tokens does not fit the prefix cache now", entry.key_len)
            self.disk.missed()
            return False
        load = self.disk.load(entry)
        if self._wake is not None:
            wake = self._wake
            load.add_done_callback(lambda _: wake())
        self.pending[rid] = _Pending(request, load, time.monotonic(), reuse)
        return True

    def remove(self, request_id: str) -> Request | None:
        """Forget a request that finished while its prefix was being read."""
        self._checked.discard(request_id)
        pending = self.pending.pop(request_id, None)
        return None if pending is None else pending.request

    def forget(self, request_id: str) -> None:
        self._checked.discard(request_id)

    @property
    def has_work(self) -> bool:
        """Whether a step has something to do here (a read finished or arrays to make)."""
        return any(p.job is not None or p.load.done() for p in self.pending.values())

    def requests(self) -> list[Request]:
        return [p.request for p in self.pending.values()]

    def plan(self) -> tuple[list[DiskRestore], list[Request]]:
        """This step's restores for the runner, and requests whose read came to nothing."""
        jobs: list[DiskRestore] = []
        missed: list[Request] = []
        for rid, pending in list(self.pending.items()):
            if pending.job is None:
                if not pending.load.done():
                    continue
                pending.job = self._job(pending)
                if pending.job is None:
                    del self.pending[rid]
                    self.disk.missed()
                    missed.append(pending.request)
                    continue
            jobs.append(pending.job)
        return jobs, missed

    def _job(self, pending: _Pending) -> DiskRestore | None:
        from mlxserve.cache.codec import Restore

        try:
            loaded = pending.load.result()
        except Exception:  # a bug in the reader: the entry is a miss, serving goes on
            logger.exception("reading a prefix-cache entry from disk failed")
            return None
        if loaded is None:
            return None
        request = pending.request
        reuse = pending.reuse
        if reuse > len(loaded.tokens) or request.context_ids[:reuse] != loaded.tokens[:reuse]:
            logger.warning("a disk entry's tokens do not match the request's prefix; ignored")
            return None
        restore = Restore(loaded.layout, loaded.tensors)
        return DiskRestore(request.request_id, loaded.tokens, restore)

    def finish(self, job: DiskRestore) -> Request | None:
        """Put a finished restore into the RAM cache; returns the request to requeue."""
        pending = self.pending.pop(job.request_id, None)
        if pending is None:
            return None  # the request finished meanwhile
        stored = False
        if job.cache is not None and job.error is None:
            try:
                stored = self.prefix_cache.insert(job.key_ids, job.cache)
            except ValueError:
                logger.exception("the prefix cache refused a restored entry")
        if stored:
            self.disk.restored(pending.reuse, time.monotonic() - pending.started)
        else:
            self.disk.missed()
        return pending.request


def advance_restores(restores: list[DiskRestore], done: list[DiskRestore]) -> None:
    """Make the next slice of each restore's arrays (on the owner thread); those whose
    arrays are all made, or that failed, go to `done`."""
    for job in restores:
        try:
            if job.restore.advance(job.max_bytes):
                job.cache = job.restore.caches()
                done.append(job)
        except (ValueError, RuntimeError) as e:  # a bad entry is a miss, not a failure
            logger.warning("restoring a prefix-cache entry from disk failed: %s", e)
            job.error = f"{type(e).__name__}: {e}"
            done.append(job)
            mx.clear_cache()
