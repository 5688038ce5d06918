"""`GET /v1/status` checked field by field against a scripted run, held step by step.

The scripted model's calls pass a gate the test opens one call at a time, so
the test sees the request waiting, prefilling part of its prompt, decoding,
and gone, and compares every figure with what the client and the engine say.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, serve_args
from status_helpers import Gate, fetch_status, wait_for, wrapped_scripted

from mlxserve.api.status.document import quantization
from mlxserve.api.status.history import engine_totals, percentile

pytestmark = pytest.mark.slow

MODEL = "status-model"
SCRIPT = "The quick brown fox jumps over the lazy dog, again and again, all day long."
AGENT = "status-test/1.0"
# Never to appear in the status document (no prompt or output text there).
MARKER = "zanzibar-marker"
PROMPT = f"{MARKER} " + " ".join(f"word{i}" for i in range(120))
TOP_KEYS = {"models", "engine", "requests", "memory", "prefix_cache", "speculation", "errors"}
REQUEST_KEYS = {
    "id",
    "model",
    "route",
    "state",
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "ttft_s",
    "tokens_per_s",
}


class Served:
    def __init__(self, server: ServerThread, gate: Gate) -> None:
        self.server = server
        self.gate = gate
        self.url = server.url
        self.prompts: dict[str, list[int]] = {}
        server.state.on_submit = lambda rid, ids: self.prompts.__setitem__(rid, ids)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    gates: list[Gate] = []

    def loader() -> Any:
        return wrapped_scripted(SCRIPT, lambda inner: gates.append(Gate(inner)) or gates[-1])

    args = serve_args(
        "--served-model-name",
        MODEL,
        "status-alias",
        "--max-num-batched-tokens",
        "32",
        "--tool-call-parser",
        "deepseek_v4",
        "--reasoning-parser",
        "deepseek_v4",
    )
    server = ServerThread(args, loader).start()
    try:
        yield Served(server, gates[0])
    finally:
        gates[0].open()
        server.stop()


def stream_chat(url: str, result: dict[str, Any]) -> None:
    """One streamed chat request; `result` gets its id and the final usage."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"User-Agent": AGENT}
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            result["id"] = chunk["id"]
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]


def moved_on(url: str, done: int) -> dict[str, Any] | None:
    """The request, once it is no longer prefilling with `done` prompt tokens or fewer."""
    r = only_request(url)
    if r is None:
        return None
    progress = r["prefill"]
    if r["state"] in ("waiting", "prefilling") and (progress is None or progress["done"] <= done):
        return None
    return r


def only_request(url: str) -> dict[str, Any] | None:
    doc = fetch_status(url)
    assert MARKER not in json.dumps(doc)
    requests = doc["requests"]
    assert len(requests) <= 1
    return requests[0] if requests else None


def test_status_follows_a_scripted_run_field_by_field(served: Served) -> None:
    url, gate = served.url, served.gate
    before = fetch_status(url)
    assert set(before) >= TOP_KEYS and before["requests"] == []
    gate.close()
    result: dict[str, Any] = {}
    client = threading.Thread(target=stream_chat, args=(url, result))
    client.start()
    try:
        first = wait_for(lambda: only_request(url), what="the request in /v1/status")
        assert set(first) >= REQUEST_KEYS
        prompt = served.prompts[first["id"]]
        assert first["model"] == MODEL and first["route"] == "/v1/chat/completions"
        assert first["dialect"] == "openai-chat" and first["user_agent"] == AGENT
        assert first["prompt_tokens"] == len(prompt)
        assert first["state"] in ("waiting", "prefilling")
        assert first["generated_tokens"] == 0 and first["cached_tokens"] == 0
        assert first["ttft_s"] is None and first["tokens_per_s"] is None

        # One chunk of the prompt at a time (32 tokens of a prompt several times that):
        # each call let through moves the progress on, within the prompt.
        seen = [0]
        for _ in range(2):
            gate.allow(1)
            r = wait_for(lambda: moved_on(url, seen[-1]), what="the next chunk of the prompt")
            assert r["state"] == "prefilling", r
            assert r["prefill"]["total"] == len(prompt)
            assert seen[-1] < r["prefill"]["done"] < len(prompt)
            assert r["prefill"]["fraction"] == pytest.approx(
                r["prefill"]["done"] / len(prompt), abs=1e-3
            )
            seen.append(r["prefill"]["done"])

        def decoding() -> dict[str, Any] | None:
            if not gate.waiting_calls():  # the last call let through has started
                gate.allow(1)
            r = only_request(url)
            return r if r and r["state"] == "decoding" and r["generated_tokens"] >= 3 else None

        r = wait_for(decoding, what="the request decoding")
        assert r["prefill"] is None and r["ttft_s"] > 0 and r["tokens_per_s"] > 0
        assert r["cached_tokens"] == 0 and r["age_s"] >= r["ttft_s"]
    finally:
        gate.open()
        client.join(60)
    usage = result["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert r["generated_tokens"] < usage["completion_tokens"]
    after = fetch_status(url)
    assert after["requests"] == []
    engine = after["engine"]
    assert (
        engine["generation_tokens"] - before["engine"]["generation_tokens"]
        == (usage["completion_tokens"])
    )
    assert engine["prompt_tokens"] - before["engine"]["prompt_tokens"] == len(prompt)
    assert engine["finished"] - before["engine"]["finished"] == 1
    assert engine["alive"] and not engine["stalled"] and engine["step_ms"] > 0
    assert after["prefix_cache"]["misses"] - before["prefix_cache"]["misses"] == 1

    # The same conversation again: its cached tokens, as the client will be told.
    gate.close()
    again: dict[str, Any] = {}
    client = threading.Thread(target=stream_chat, args=(url, again))
    client.start()
    try:

        def admitted() -> dict[str, Any] | None:
            if not gate.waiting_calls():
                gate.allow(1)
            r = only_request(url)
            return r if r and r["state"] != "waiting" and r["cached_tokens"] else None

        warm = wait_for(admitted, what="the second request admitted")
    finally:
        gate.open()
        client.join(60)
    assert warm["cached_tokens"] == again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    final = fetch_status(url)
    assert final["prefix_cache"]["hits"] - after["prefix_cache"]["hits"] == 1
    assert final["prefix_cache"]["enabled"] and final["prefix_cache"]["hit_ratio"] > 0


def test_models_memory_and_speculation_sections(served: Served) -> None:
    doc = fetch_status(served.url)
    (model,) = doc["models"]
    assert model["name"] == MODEL and model["aliases"] == ["status-alias"]
    assert model["state"] == "ok" and model["family"] == "deepseek_v4" and model["default"]
    assert model["quantization"] is None and model["context_limit"] == 65536
    assert doc["health"] == {"status": "ok"} and doc["uptime_s"] > 0
    memory = doc["memory"]
    assert (
        memory["kv_budget_bytes"] > 0 and 0 <= memory["kv_used_bytes"] <= memory["kv_budget_bytes"]
    )
    assert doc["speculation"]["enabled"] is False and doc["speculation"]["models"] == {MODEL: None}


def test_errors_keep_route_status_and_message(served: Served) -> None:
    bad = httpx.post(served.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400
    missing = httpx.post(served.url + "/v1/messages", json={"model": MODEL}, timeout=30)
    assert missing.status_code == 400
    errors = fetch_status(served.url)["errors"]
    newest, older = errors[0], errors[1]
    assert newest["route"] == "/v1/messages" and newest["status"] == 400
    assert newest["message"] == missing.json()["error"]["message"]
    assert older["route"] == "/v1/chat/completions" and older["status"] == 400
    assert older["message"] == bad.json()["error"]["message"]
    assert older["time"] <= newest["time"]


def test_status_says_what_it_cost(served: Served) -> None:
    response = httpx.get(served.url + "/v1/status", timeout=30)
    name, _, duration = response.headers["server-timing"].partition(";dur=")
    assert name == "status" and float(duration) > 0
    assert response.headers["cache-control"] == "no-store"


def test_history_since(served: Served) -> None:
    def sampled() -> list[dict[str, Any]]:
        return fetch_status(served.url, since=0)["history"]["samples"]

    samples = wait_for(lambda: len(sampled()) >= 2 and sampled(), what="two samples")
    keys = {"t", "tokens_per_s", "in_flight", "waiting", "hit_ratio", "kv_used_bytes"}
    assert keys <= set(samples[-1])
    later = fetch_status(served.url, since=samples[-2]["t"])["history"]["samples"]
    assert later and later[0]["t"] == samples[-1]["t"]
    assert "history" not in fetch_status(served.url)


def test_root_probe_and_page_routes(served: Served) -> None:
    url = served.url
    probe = httpx.get(url + "/", timeout=30)
    assert probe.json() == {"name": "mlxserve", "model": MODEL}
    assert httpx.head(url + "/", timeout=30).status_code == 200
    browser = httpx.get(url + "/", headers={"Accept": "text/html"}, timeout=30)
    assert browser.status_code == 307 and browser.headers["location"] == "/dashboard"
    page = httpx.get(url + "/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    for name in ("dashboard.js", "dashboard.css"):
        assert httpx.get(f"{url}/dashboard/{name}", timeout=30).status_code == 200


def test_no_dashboard_and_api_key() -> None:
    args = serve_args("--no-dashboard", "--api-key", "sekrit", "--served-model-name", MODEL)
    with ServerThread(args, lambda: wrapped_scripted(SCRIPT, Gate)) as server:
        assert httpx.get(server.url + "/dashboard", timeout=30).status_code == 404
        probe = httpx.get(server.url + "/", headers={"Accept": "text/html"}, timeout=30)
        assert probe.status_code == 200 and probe.json()["model"] == MODEL
        assert httpx.get(server.url + "/v1/status", timeout=30).status_code == 401
        assert set(fetch_status(server.url, key="sekrit")) >= TOP_KEYS


def test_units() -> None:
    assert quantization({"quantization": {"bits": 4, "group_size": 64}}) == {
        "bits": 4,
        "group_size": 64,
    }
    assert quantization({}) is None
    assert percentile([], 0.5) is None and percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    pooled = {"kv_pool": {"budget_bytes": 100}, "cache_bytes": 10, "generation_tokens": 5}
    totals = engine_totals([pooled, dict(pooled, cache_bytes=20)])
    assert totals.kv_budget_bytes == 100 and totals.kv_used_bytes == 30 and totals.generated == 10
