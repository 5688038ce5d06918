"""The server never leaves a client hanging: a dead engine, keep-alive, stop strings,
per-request state on every path, and many streams with dropped connections."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_fixtures import (
    ServerThread,
    assert_error_shape,
    chat_body,
    metric,
    serve_args,
    serve_in_thread,
)
from engine_helpers import KillSwitch, ModelWrapper, SlowModel, idle, wait_until, wrapped_loader
from server_health import health_status

from mlxserve.models.tiny.scripted import scripted_model

pytestmark = pytest.mark.slow

BAD_TOKEN = 4077


class Broken(ModelWrapper):
    def check(self, inputs: Any) -> None:
        if BAD_TOKEN in inputs.reshape(-1).tolist():
            raise RuntimeError("broken forward")


def _sse_lines(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line:
            yield line


def test_a_dead_engine_fails_open_streams_and_health_says_so(model_dir_factory) -> None:
    loader, holder = wrapped_loader(model_dir_factory("llama"), KillSwitch)
    args = serve_args("--no-exit-on-engine-failure")
    with ServerThread(args, loader) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        body = chat_body(max_tokens=20_000, stream=True)
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = _sse_lines(response)
            assert next(lines).startswith("data: ")  # the role chunk
            holder["model"].armed.set()
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert "the engine failed" in error["message"] and "EngineKill" in error["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "EngineKill" in health.json()["error"]
        assert metric(http.get("/metrics").text, "mlxserve_engine_alive") == 0
        err = assert_error_shape(http.post("/v1/chat/completions", json=chat_body()), 503)
        assert err["code"] == "engine_failed"
        assert srv.state.engine.open_requests()["streams"] == 0  # type: ignore[attr-defined]


def test_exit_on_engine_failure_ends_the_server_non_zero(model_dir_factory) -> None:
    loader, holder = wrapped_loader(model_dir_factory("llama"), KillSwitch)
    args = serve_args()
    state, thread, result = serve_in_thread(args, loader)
    url = f"http://{args.host}:{args.port}"
    assert state.engine.ready
    assert wait_until(lambda: health_status(url) == 200, timeout=30)
    holder["model"].armed.set()
    with httpx.Client(base_url=url, timeout=30) as http:
        response = http.post("/v1/chat/completions", json=chat_body())
    assert_error_shape(response, 500)
    thread.join(timeout=15)
    assert result == [1]


def test_keepalive_comments_flow_while_a_prompt_prefills(model_dir_factory) -> None:
    path = model_dir_factory("llama")
    loader, holder = wrapped_loader(path, SlowModel, delay_s=0.5, prefill_only=True)
    with ServerThread(serve_args("--keepalive-interval", "0.05"), loader) as srv:
        holder["model"].armed = True
        raw = b""
        with httpx.stream(
            "POST", srv.base_url + "/chat/completions", json=chat_body(stream=True), timeout=30
        ) as response:
            for chunk in response.iter_bytes():
                raw += chunk
        events = raw.split(b"\n\n")
        assert events[0].startswith(b"data: ") and b'"role":"assistant"' in events[0]
        assert events[1] == b": keep-alive"  # while the prompt prefills, before any token
        assert raw.endswith(b"data: [DONE]\n\n")


def test_a_stop_string_is_a_normal_stop() -> None:
    script = "Hello there. STOP and some words after the stop."
    with ServerThread(serve_args(), lambda: scripted_model(script)) as srv:
        body = chat_body(stop=["STOP"], max_tokens=64)
        out = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=30).json()
        assert out["choices"][0]["finish_reason"] == "stop"
        assert "STOP" not in json.dumps(out["choices"][0]["message"])
        engine = srv.state.engine
        assert wait_until(lambda: idle(engine))  # type: ignore[arg-type]
        stats = engine.stats()
        assert stats["aborted"] == 0 and stats["finished"] == 1
        # The prompt snapshot and the `prompt + output` entry of a finished request.
        assert stats["prefix_cache"]["inserts"] == 2
        metrics = httpx.get(srv.url + "/metrics").text
        assert metric(metrics, "mlxserve_requests_total", endpoint="chat", outcome="ok") == 1


@pytest.fixture(scope="module")
def llama_server(model_dir_factory) -> Iterator[ServerThread]:
    loader, _ = wrapped_loader(model_dir_factory("llama"), Broken)
    with ServerThread(serve_args("--max-num-seqs", "8"), loader) as srv:
        yield srv


def _idle(srv: ServerThread) -> bool:
    return wait_until(lambda: idle(srv.state.engine), timeout=5)  # type: ignore[arg-type]


def test_no_per_request_state_is_left_on_any_path(llama_server: ServerThread) -> None:
    srv = llama_server
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        assert http.post("/chat/completions", json=chat_body()).status_code == 200
        assert _idle(srv)
        with http.stream("POST", "/chat/completions", json=chat_body(stream=True)) as r:
            assert list(_sse_lines(r))[-1] == "data: [DONE]"
        assert _idle(srv)
        failed = http.post("/completions", json={"prompt": [3, BAD_TOKEN], "max_tokens": 4})
        assert assert_error_shape(failed, 500)["code"] == "generation_failed"
        assert _idle(srv)
        body = chat_body(stream=True, max_tokens=20_000)
        with http.stream("POST", "/chat/completions", json=body) as r:  # gone mid-stream
            next(_sse_lines(r))
        assert _idle(srv)
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.Client(base_url=srv.base_url, timeout=0.5) as quick,
    ):
        quick.post("/chat/completions", json=chat_body(max_tokens=20_000))  # gone, not streaming
    assert _idle(srv)


def _text_outcomes(srv: ServerThread) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics").text
    return {
        s.labels["outcome"]: float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "mlxserve_requests_total" and s.labels.get("endpoint") == "text"
    }


def test_a_failed_generation_counts_once(llama_server: ServerThread) -> None:
    """The run counts its outcome; the 500 it answers is not a second request."""
    srv = llama_server
    before = _text_outcomes(srv)
    body = {"prompt": [5, BAD_TOKEN], "max_tokens": 4}
    assert httpx.post(srv.base_url + "/completions", json=body, timeout=30).status_code == 500
    with httpx.stream("POST", srv.base_url + "/completions", json=body | {"stream": True}) as r:
        assert "generation_failed" in r.read().decode()
    after = _text_outcomes(srv)
    grown = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert grown == {"error": 2.0}


async def _load_stream(client: httpx.AsyncClient, i: int, drop: bool) -> str | None:
    body = chat_body(f"Stream number {i}", stream=True, max_tokens=8)
    finish = None
    async with client.stream("POST", "/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if drop:
                return "dropped"
            choices = json.loads(line[6:]).get("choices") or [{}]
            finish = choices[0].get("finish_reason") or finish
    return finish


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_sixty_four_streams_with_a_third_dropping(llama_server: ServerThread) -> None:
    srv = llama_server

    async def wave(n: int, drop_every: int | None) -> list[str | None]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60, limits=limits) as client:
            return list(
                await asyncio.gather(
                    *(
                        _load_stream(client, i, drop_every is not None and i % drop_every == 0)
                        for i in range(n)
                    )
                )
            )

    results = asyncio.run(wave(64, 3))
    kept = [r for i, r in enumerate(results) if i % 3 != 0]
    assert len(kept) == 42 and all(r in ("stop", "length") for r in kept), results
    assert _idle(srv)
    stats = srv.state.engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    sizes = []
    for _ in range(3):  # 120 more requests, 40 at a time
        assert all(r in ("stop", "length") for r in asyncio.run(wave(40, None)))
        sizes.append(_rss_bytes())
    assert _idle(srv)
    # Flat: the last 80 requests add no more than a few MiB of resident memory (the long
    # runs are tests/test_memory_flat.py's and `bench soak`'s).
    assert sizes[-1] - sizes[0] < 16 << 20, sizes
