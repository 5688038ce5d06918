"""Request-scoped objects are released when their request ends, on every path.

A burst of mixed requests on all three dialects (answered, streamed, dropped
mid-stream, dropped while waiting for a whole body, refused as bad input) and
then, once the server is idle, every object a request created is gone:
counted by `gc`, not by the process's memory.
"""

from __future__ import annotations

import gc
import json
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, serve_args

from mlxserve.api.detok import IncrementalDecoder
from mlxserve.api.pipeline import OutputPipeline
from mlxserve.api.run import GenerationRun, RunMeta
from mlxserve.api.stops import StopMatcher
from mlxserve.engine.request import Request
from mlxserve.engine.sampling import SamplerState
from mlxserve.models.tiny.scripted import scripted_model
from mlxserve.parsers.chain import OutputParser

pytestmark = pytest.mark.slow

MODEL = "test-model"
REQUEST_SCOPED = (
    GenerationRun,
    RunMeta,
    OutputPipeline,
    IncrementalDecoder,
    StopMatcher,
    OutputParser,
    Request,
    SamplerState,
)
ROUTES = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    args = serve_args(
        "--served-model-name", MODEL, "--max-num-seqs", "4",
        "--tool-call-parser", "deepseek_v4", "--reasoning-parser", "deepseek_v4",
    )  # fmt: skip
    with ServerThread(args, lambda: scripted_model("tick " * 4000)) as srv:
        yield srv


def _body(dialect: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    user = [{"role": "user", "content": "Go on."}]
    if dialect == "chat":
        return {"model": MODEL, "messages": user, "max_tokens": max_tokens, "stream": stream}
    if dialect == "messages":
        return {"model": MODEL, "messages": user, "max_tokens": max_tokens, "stream": stream}
    return {"model": MODEL, "input": "Go on.", "max_output_tokens": max_tokens, "stream": stream}


def _answered(url: str, dialect: str, stream: bool) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post(ROUTES[dialect], json=_body(dialect, 4, stream))
        assert r.status_code == 200, r.text


def _dropped_mid_stream(url: str, dialect: str) -> None:
    with (
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("POST", ROUTES[dialect], json=_body(dialect, 4000, True)) as r,
    ):
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            json.loads(next(events)[6:])
    # Leaving the block closed the connection mid-stream.


def _dropped_while_waiting(url: str, dialect: str) -> None:
    with (
        httpx.Client(base_url=url, timeout=0.5) as impatient,
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.post(ROUTES[dialect], json=_body(dialect, 4000, False))


def _refused(url: str, dialect: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        bad = {"model": MODEL, "max_tokens": -3, "max_output_tokens": -3, "messages": "nope"}
        assert 400 <= http.post(ROUTES[dialect], json=bad).status_code < 500


def _live_counts() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects() if isinstance(o, REQUEST_SCOPED))


def _wait_idle(server: ServerThread, timeout: float = 60.0) -> None:
    """Until the engine holds no request and the api layer no run (the aborts of
    dropped connections land after the client has gone)."""
    engine: Any = server.state.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and not server.state.live_runs:
            return
        time.sleep(0.05)
    raise AssertionError(f"still busy: {engine.stats()}, runs {len(server.state.live_runs)}")


def test_a_mixed_burst_leaves_no_request_objects_behind(server: ServerThread) -> None:
    _answered(server.url, "chat", False)  # lazily built, long-lived objects settle first
    _wait_idle(server)
    before = _live_counts()
    jobs = []
    with ThreadPoolExecutor(max_workers=6) as pool:
        for dialect in ROUTES:
            jobs += [
                pool.submit(_answered, server.url, dialect, False),
                pool.submit(_answered, server.url, dialect, True),
                pool.submit(_dropped_mid_stream, server.url, dialect),
                pool.submit(_dropped_while_waiting, server.url, dialect),
                pool.submit(_refused, server.url, dialect),
            ]
        for job in jobs:
            job.result()
    _wait_idle(server)
    after = _live_counts()
    assert after == before, f"request objects left behind: {after - before}"
    assert len(server.state.live_runs) == 0
