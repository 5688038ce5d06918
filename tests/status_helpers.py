"""Helpers of the status tests: models that let a test hold or pace the engine's steps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from engine_helpers import ModelWrapper

from mlxserve.models.loaded import LoadedModel
from mlxserve.models.tiny.scripted import scripted_model


class Gate(ModelWrapper):
    """While closed, each model call waits for `allow`; `open` lets every call through."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self._cond = threading.Condition()
        self._closed = False
        self._allowed = 0

    def check(self, inputs: Any) -> None:
        with self._cond:
            while self._closed and self._allowed == 0:
                self._cond.wait()
            if self._closed:
                self._allowed -= 1

    def close(self) -> None:
        with self._cond:
            self._closed, self._allowed = True, 0

    def allow(self, calls: int = 1) -> None:
        with self._cond:
            self._allowed += calls
            self._cond.notify_all()

    def waiting_calls(self) -> int:
        """Calls let through that have not started yet."""
        with self._cond:
            return self._allowed

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()


class Paced(ModelWrapper):
    """A model call costs `fixed_s` plus `per_token_s` per input token (a slow device)."""

    def __init__(self, inner: Any, fixed_s: float, per_token_s: float) -> None:
        super().__init__(inner)
        self.fixed_s = fixed_s
        self.per_token_s = per_token_s

    def check(self, inputs: Any) -> None:
        time.sleep(self.fixed_s + self.per_token_s * inputs.size)


def wrapped_scripted(script: Any, wrap: Callable[[Any], ModelWrapper]) -> LoadedModel:
    model = scripted_model(script)
    model.model = wrap(model.model)
    return model


def fetch_status(url: str, key: str | None = None, **params: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(url + "/v1/status", params=params, headers=headers, timeout=30)
    response.raise_for_status()
    return dict(response.json())


def wait_for(probe: Callable[[], Any], timeout: float = 60.0, what: str = "a condition") -> Any:
    """Poll `probe` until it returns something truthy, and return that (a deadline, not a
    speed check: the timeout is generous)."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
