"""The one way tests ask a server whether it is up: `/health`, polled."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def health_status(url: str, timeout: float = 5) -> int | None:
    """`/health`'s status code, or None while nothing answers."""
    try:
        return httpx.get(url + "/health", timeout=timeout).status_code
    except httpx.TransportError:
        return None


def wait_healthy(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout: float = 120,
    describe_exit: Callable[[], str] = lambda: "",
) -> None:
    """Poll `/health` until it answers 200. A `proc` that exits first raises
    RuntimeError (with `describe_exit()`, e.g. its log); the deadline,
    TimeoutError (a deadline for a stuck start, not a speed check)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {describe_exit()}")
        if health_status(url, timeout=2) == 200:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become ready: {describe_exit()}")
