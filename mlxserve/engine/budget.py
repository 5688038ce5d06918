"""The KV byte budget: what one request's cache costs, and the bytes an engine may hold.

The engine admits a request only when its cache fits (rule 9 of
docs/architecture.md). `CacheCost` bounds one request's cache bytes by its
tokens (measured on the loaded model by `cost_probe`); `KVBudget` is one
engine's budget; `KVPool` is the budget several engines of one server share
(one per served model).

The pool keeps the books between engines; each engine's scheduler owns its
requests and its prefix cache:

- `held[m]`: what engine m may touch now: its running caches (the scheduler's
  upper bound) plus its prefix cache. An engine admits a request only by
  `claim`, which checks the new figure against what the others hold under the
  pool's lock, so two engines never both take the same bytes.
- `wanted[m]`: bytes engine m waits for with nothing running. The others
  then shrink their prefix caches (entries nobody is using) at their next
  step; the pool wakes them, and wakes m again when anyone's holding drops.
- `peak_measured`: the largest sum of the engines' measured cache bytes,
  which tests and `/v1/cache/stats` compare with the budget.

The pool's methods are called from the engines' owner threads (and `stats`
from the event loop); one lock guards the books.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

logger = logging.getLogger(__name__)

SLOPE_PERIOD = 256
# Held back from the device's memory besides the weights (activations, the allocator's cache).
MARGIN_FRACTION = 0.10
MIN_MARGIN_BYTES = 1 << 30


@dataclass(frozen=True)
class CacheCost:
    """An upper bound on one request's cache bytes as a function of the tokens it holds."""

    fixed_bytes: int
    bytes_per_token: float

    def row(self, tokens: int) -> int:
        return self.fixed_bytes + math.ceil(self.bytes_per_token * max(tokens, 0))

    def total(self, lengths: Sequence[int], batched: bool) -> int:
        """Bytes of these requests' caches: one left-padded batch, or each alone."""
        if not lengths:
            return 0
        if batched:
            return len(lengths) * self.row(max(lengths))
        return sum(self.row(n) for n in lengths)


def fit_cost(samples: Iterable[tuple[int, int]]) -> CacheCost:
    """The line above every (tokens, bytes) sample.

    Its slope is the largest growth between samples a whole number of
    `SLOPE_PERIOD` tokens apart (mlx-lm preallocates KV in 256-token blocks and
    compressed caches compact at power-of-two boundaries, so closer samples can
    jump by a whole block); its intercept is the largest remainder.
    """
    points = sorted(set(samples))
    if not points:
        raise ValueError("no samples")
    slopes = [
        (b2 - b1) / (n2 - n1)
        for i, (n1, b1) in enumerate(points)
        for n2, b2 in points[i + 1 :]
        if (n2 - n1) % SLOPE_PERIOD == 0
    ]
    if not slopes:  # too few probes: the steepest growth between any two
        slopes = [
            (b2 - b1) / (n2 - n1)
            for i, (n1, b1) in enumerate(points)
            for n2, b2 in points[i + 1 :]
            if n2 > n1
        ]
    slope = max([0.0, *slopes])
    if len(points) == 1:
        tokens, nbytes = points[0]
        slope = nbytes / max(tokens, 1)
    fixed = max(math.ceil(b - slope * n) for n, b in points)
    # One token more: a batch's buffer may hold one row past the longest request's.
    return CacheCost(max(0, fixed) + math.ceil(slope), slope)


def weights_nbytes(module: Any) -> int:
    """Bytes of a model's parameters (0 where they cannot be read)."""
    from mlx.utils import tree_flatten

    parameters = getattr(module, "parameters", None)
    if parameters is None:
        return 0
    leaves: list[tuple[str, Any]] = tree_flatten(parameters())  # type: ignore[assignment]
    return sum(v.nbytes for _, v in leaves if isinstance(v, mx.array))


def device_memory_bytes() -> int:
    """Metal's recommended working set, or physical RAM elsewhere."""
    try:
        if mx.metal.is_available():
            info = mx.metal.device_info()
            size = info.get("max_recommended_working_set_size") or info.get("memory_size")
            if isinstance(size, int) and size > 0:
                return size
    except (AttributeError, RuntimeError):
        logger.debug("no Metal device info; using physical RAM")
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def default_kv_budget(weights_bytes: int, device_bytes: int | None = None) -> int:
    """The device's memory minus the weights and a margin (at least 64 MiB)."""
    device = device_memory_bytes() if device_bytes is None else device_bytes
    margin = max(MIN_MARGIN_BYTES, int(device * MARGIN_FRACTION))
    return max(64 << 20, device - weights_bytes - margin)


@dataclass(frozen=True)
class KVBudget:
    """The engine's byte budget and what one request's cache costs on this model.

    With a `pool` (several models in one server) the budget is the pool's,
    shared with the other engines; `member` names this engine in it.
    """

    budget_bytes: int
    cost: CacheCost
    batched: bool
    pool: KVPool | None = None
    member: str = ""
    # Bytes of one image position's features, held while its prompt prefills (a vision
    # checkpoint; 0 for a text model).
    feature_bytes_per_position: int = 0

    def total(self, lengths: Sequence[int]) -> int:
        return self.cost.total(lengths, self.batched)

    def held(self, lengths: Sequence[int], image_positions: int) -> int:
        """Caches of these lengths, and the features of `image_positions` image positions."""
        return self.total(lengths) + self.feature_bytes_per_position * image_positions

    @property
    def whole_bytes(self) -> int:
        """The whole budget (the shared pool's, with several models)."""
        return self.budget_bytes if self.pool is None else self.pool.total_bytes

    def room(self) -> int:
        """Bytes this engine's caches may take: the budget less other models' holdings."""
        return self.budget_bytes if self.pool is None else self.pool.room(self.member)

    def prefix_room(self) -> int:
        """`room`, less what other models wait for: a prefix cache gives way first."""
        return self.budget_bytes if self.pool is None else self.pool.prefix_room(self.member)

    def claim(self, nbytes: int) -> bool:
        """Whether caches of `nbytes` fit (in a shared pool, taken from it at once)."""
        if self.pool is None:
            return nbytes <= self.budget_bytes
        return self.pool.claim(self.member, nbytes)

    def publish(self, held: int, waiting_for: int) -> None:
        """Tell a shared pool what this engine holds, and what its head waits for (0: none)."""
        if self.pool is not None:
            self.pool.hold(self.member, held)
            self.pool.want(self.member, waiting_for)


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
