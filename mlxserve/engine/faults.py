"""Fault injection points of the engine (for tests of rules 2 and 8 of docs/architecture.md).

An engine built with a `FaultHook` calls it at each named point of a step
with the ids of the requests that point touches; a hook that raises there
stands for any error in that phase. Production engines pass no hook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

FaultHook = Callable[[str, Sequence[str]], None]

SCHEDULE = "schedule"  # before planning a step
ADMIT = "admit"  # admitting one waiting request (prefix-cache lookup)
FORWARD = "forward"  # a model call (prefill chunk or decode batch)
SAMPLE = "sample"  # sampling a batch's next tokens
SNAPSHOT = "snapshot"  # copying a cache for the prefix cache
RELEASE = "release"  # freeing finished requests' caches
UPDATE = "update"  # applying one request's output
INSERT = "insert"  # storing a snapshot in the prefix cache
RECOVER = "recover"  # the engine's own handling of a failed phase

PHASES = (SCHEDULE, ADMIT, FORWARD, SAMPLE, SNAPSHOT, RELEASE, UPDATE, INSERT, RECOVER)
