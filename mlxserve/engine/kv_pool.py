"""One KV byte budget shared by the engines of one server (one engine per served model).

Each engine's scheduler owns its requests and its prefix cache; the pool only
keeps the books between them (rule 9 of docs/architecture.md across models):

- `held[m]`: what engine m may touch now: its running caches (the scheduler's
  upper bound) plus its prefix cache. An engine admits a request only by
  `claim`, which checks the new figure against what the others hold under the
  pool's lock, so two engines never both take the same bytes.
- `wanted[m]`: bytes engine m waits for with nothing running. The others
  then shrink their prefix caches (entries nobody is using) at their next
  step; the pool wakes them, and wakes m again when anyone's holding drops.
- `peak_measured`: the largest sum of the engines' measured cache bytes,
  which tests and `/v1/cache/stats` compare with the budget.

All methods are called from the engines' owner threads (and `stats` from the
event loop); one lock guards the books.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mlxserve.engine.memory import default_kv_budget


class KVPool:
    def __init__(self, budget_bytes: int | None = None, device_bytes: int | None = None) -> None:
        self._lock = threading.Lock()
        self._explicit = budget_bytes
        self._device = device_bytes
        self._weights: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._wanted: dict[str, int] = {}
        self._measured: dict[str, int] = {}
        self._wakes: dict[str, Callable[[], None]] = {}
        self.peak_measured = 0

    def join(self, member: str, weights_bytes: int, wake: Callable[[], None]) -> None:
        """An engine whose model has loaded (its weights leave less room when derived)."""
        with self._lock:
            self._weights[member] = weights_bytes
            self._held[member] = 0
            self._wanted[member] = 0
            self._measured[member] = 0
            self._wakes[member] = wake

    @property
    def total_bytes(self) -> int:
        """--kv-memory-bytes, else the device's memory minus every model's weights."""
        if self._explicit is not None:
            return self._explicit
        with self._lock:
            weights = sum(self._weights.values())
        return default_kv_budget(weights, self._device)

    def room(self, member: str) -> int:
        """Bytes `member` may hold: the budget less what the other engines hold."""
        total = self.total_bytes
        with self._lock:
            return total - self._others(self._held, member)

    def prefix_room(self, member: str) -> int:
        """`room`, less what the others are waiting for (prefix caches give way first)."""
        total = self.total_bytes
        with self._lock:
            return total - self._others(self._held, member) - self._others(self._wanted, member)

    def claim(self, member: str, nbytes: int) -> bool:
        """Hold `nbytes` if they fit beside the others' holdings (one atomic check)."""
        total = self.total_bytes
        with self._lock:
            if nbytes + self._others(self._held, member) > total:
                return False
            self._held[member] = nbytes
            self._wanted[member] = 0
        return True

    def hold(self, member: str, nbytes: int) -> None:
        """What `member` holds after its step; a drop wakes the engines waiting for room."""
        with self._lock:
            dropped = nbytes < self._held.get(member, 0)
            self._held[member] = nbytes
            waiting = [m for m, w in self._wanted.items() if w > 0 and m != member]
            wakes = [self._wakes[m] for m in waiting] if dropped else []
        for wake in wakes:
            wake()

    def want(self, member: str, nbytes: int) -> None:
        """`member` waits for `nbytes` with nothing running: the others make room."""
        with self._lock:
            newly = self._wanted.get(member, 0) != nbytes and nbytes > 0
            self._wanted[member] = nbytes
            wakes = [w for m, w in self._wakes.items() if m != member] if newly else []
        for wake in wakes:
            wake()

    def measured(self, member: str, nbytes: int) -> None:
        """The bytes `member`'s caches really hold after a step."""
        with self._lock:
            self._measured[member] = nbytes
            self.peak_measured = max(self.peak_measured, sum(self._measured.values()))

    def stats(self) -> dict[str, Any]:
        total = self.total_bytes
        with self._lock:
            return {
                "budget_bytes": total,
                "held_bytes": dict(self._held),
                "cache_bytes": dict(self._measured),
                "peak_cache_bytes": self.peak_measured,
            }

    @staticmethod
    def _others(book: dict[str, int], member: str) -> int:
        return sum(v for m, v in book.items() if m != member)
