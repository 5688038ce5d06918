"""Giving freed heap memory back to the OS where the allocator keeps it (glibc).

glibc keeps freed blocks inside its arenas for reuse. A server whose
allocations churn for days (cache snapshots copied and dropped, requests
coming and going, response bodies built) sees its RSS creep up while little
of it is in use: in `bench soak` the arena's free part grew by tens of MB in
ten minutes. `malloc_trim(0)` returns the free pages. It runs on the owner
thread between steps, at most every `TRIM_EVERY_S`; it takes well under a
millisecond here. Other platforms' allocators return memory themselves, and
there this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

TRIM_EVERY_S = 30.0


def _glibc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to trim through
        return None
    trim = getattr(libc, "malloc_trim", None)
    return trim if callable(trim) else None


class HeapTrimmer:
    """Calls glibc's `malloc_trim` at most every `every_s` seconds (a no-op elsewhere)."""

    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self.every_s = every_s
        self._trim = _glibc_trim()
        self._next = time.monotonic() + every_s
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> None:
        if self._trim is None:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        self._trim(0)
        self.trims += 1
