"""The step watchdog: a step that never returns is engine death, never a silent hang.

`/health` answers 503 "engine stalled", `/metrics` shows it, every open request
fails with a clear error, and with `--exit-on-engine-failure` the server exits
non-zero for its supervisor.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, chat_body, metric, serve_args, serve_in_thread
from engine_helpers import Wedge, collect, wait_until, wrapped_loader
from server_health import health_status

from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import EngineNotReady, SamplingParams

pytestmark = pytest.mark.slow

STEP_TIMEOUT = "0.5"


def _wedged(path: Any) -> tuple[Any, dict[str, Any]]:
    return wrapped_loader(path, Wedge)


def test_a_stalled_step_fails_every_open_request(model_dir_factory) -> None:
    loader, holder = _wedged(model_dir_factory("llama"))

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(step_timeout_s=0.5), loader)
        engine.start()
        await engine.wait_ready(timeout=120)
        wedge = holder["model"]
        try:
            wedge.armed.set()
            streams = [
                collect(engine.submit([5 + i, 6, 7], SamplingParams(max_tokens=50)))
                for i in range(3)
            ]
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)
            for events in results:
                assert events[-1].finish_reason == "error"
                assert "engine stalled" in (events[-1].error or "")
            assert wedge.entered.is_set()
            stats = engine.stats()
            assert stats["stalled"] and not stats["alive"]
            with pytest.raises(EngineNotReady, match="engine stalled"):
                engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
        finally:
            wedge.release.set()
            await engine.shutdown()

    asyncio.run(main())


def test_health_and_metrics_say_stalled(model_dir_factory) -> None:
    loader, holder = _wedged(model_dir_factory("llama"))
    args = serve_args("--step-timeout", STEP_TIMEOUT, "--no-exit-on-engine-failure")
    with ServerThread(args, loader) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        wedge = holder["model"]
        try:
            assert http.get("/health").status_code == 200
            wedge.armed.set()
            response = http.post("/v1/chat/completions", json=chat_body(max_tokens=50))
            assert response.status_code >= 500
            assert "engine stalled" in response.json()["error"]["message"]
            health = http.get("/health")
            assert health.status_code == 503 and "engine stalled" in health.json()["error"]
            metrics = http.get("/metrics").text
            assert metric(metrics, "mlxserve_engine_stalled") == 1
            assert metric(metrics, "mlxserve_engine_alive") == 0
        finally:
            wedge.release.set()


def test_a_stall_ends_the_server_non_zero_when_exit_is_on(model_dir_factory) -> None:
    loader, holder = _wedged(model_dir_factory("llama"))
    args = serve_args("--step-timeout", STEP_TIMEOUT)
    state, thread, result = serve_in_thread(args, loader)
    url = f"http://{args.host}:{args.port}"
    assert state.engine.ready
    wedge = holder["model"]
    try:
        wedge.armed.set()
        with httpx.Client(base_url=url, timeout=60) as http:
            response = http.post("/v1/chat/completions", json=chat_body(max_tokens=50))
        assert response.status_code >= 500
        thread.join(timeout=60)
        assert result == [1]
    finally:
        wedge.release.set()


_WEDGED_SERVE = """
import sys, threading
import mlxserve.models as models
from mlxserve.cli import main

real_load = models.load

class Wedged:
    def __init__(self, inner):
        self.inner = inner
    def __call__(self, inputs, cache=None):
        return self.inner(inputs, cache)
    def last_logits(self, inputs, cache=None):
        if inputs.shape[1] == 3:  # the test's prompt: this forward never returns
            threading.Event().wait()
        return self.inner.last_logits(inputs, cache)

def load(*args, **kw):
    model = real_load(*args, **kw)
    model.model = Wedged(model.model)
    return model

models.load = load
sys.exit(main(["serve", sys.argv[1], "--port", sys.argv[2], "--step-timeout", "1",
               "--log-level", "warning"]))
"""


def test_a_stalled_server_process_exits_non_zero(model_dir_factory) -> None:
    """What a supervisor sees: the `mlxserve serve` process itself ends with status 1."""
    import subprocess
    import sys

    from api_fixtures import free_port

    port = free_port()
    argv = [sys.executable, "-c", _WEDGED_SERVE, str(model_dir_factory("llama")), str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: health_status(url) == 200, timeout=120)
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code >= 500
        assert proc.wait(timeout=60) == 1
        assert "engine stalled" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
