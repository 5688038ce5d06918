"""`mlxserve bench status`: what watching the server costs it, side by side.

64 concurrent streaming chat requests (`--streams`; a tiny hidden-64 llama
unless `--model` or `--url` names another) run against one server, without and
with a client that polls `/v1/status` every 250 ms as the operator page does
(`?since=` its last sample, so each poll carries the new history only).
Each round measures both sides back to back, the side that goes first
alternating from round to round; aggregate decode tokens/s is all the
completion tokens over the wall time from the first request sent to the last
token received. Figures: `status_p99_ms` (the polls' latency, p99, over
every polled round), `status_poll_overhead` (1 minus the median of the
rounds' ratios of tokens/s with polling to without; <= 0.02 means watching
costs nothing measurable), each side's median tokens/s and each round's ratio,
and what the server says building each answer cost (its `Server-Timing`):
`status_server_p99_ms` and `status_server_share` (that time over the polled
rounds' wall time), which a busy machine's noise does not move.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from mlxserve.bench.report import emit
from mlxserve.bench.serve import LocalServer, _percentile, discover_model

POLL_S = 0.25


class Poller:
    """A thread that polls `/v1/status` like the page does, timing each answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        # Milliseconds the server says each answer took to build (its Server-Timing header).
        self.server_ms: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-poller", daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        since = 0.0
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    r = client.get(f"{self.url}/v1/status", params={"since": since})
                    r.raise_for_status()
                    samples = r.json()["history"]["samples"]
                except (httpx.HTTPError, KeyError, ValueError):
                    self.failures += 1
                else:
                    self.latencies.append(time.perf_counter() - started)
                    self.server_ms.append(_server_ms(r.headers.get("server-timing", "")))
                    if samples:
                        since = samples[-1]["t"]
                self._stop.wait(max(0.0, POLL_S - (time.perf_counter() - started)))


def _server_ms(header: str) -> float:
    _, _, duration = header.partition("dur=")
    try:
        return float(duration.split(";")[0])
    except ValueError:
        return 0.0


async def _stream(client: httpx.AsyncClient, url: str, model: str, i: int, tokens: int) -> int:
    """One streamed request; the completion tokens its usage reports."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Stream {i}: tell a long story about owls."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    used = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    used = int(usage["completion_tokens"])
    return used


async def _round(url: str, model: str, streams: int, tokens: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) of `streams` concurrent requests."""
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        started = time.perf_counter()
        counts = await asyncio.gather(
            *(_stream(client, url, model, i, tokens) for i in range(streams))
        )
        return sum(counts), time.perf_counter() - started


def measure(url: str, model: str, streams: int, tokens: int, rounds: int) -> dict[str, Any]:
    asyncio.run(_round(url, model, streams, min(tokens, 4)))  # warm-up: first-call costs
    rates: dict[str, list[float]] = {"plain": [], "polled": []}
    ratios: list[float] = []
    latencies: list[float] = []
    server_ms: list[float] = []
    polled_s = 0.0
    failures = 0
    for i in range(rounds):
        sides = ("plain", "polled") if i % 2 == 0 else ("polled", "plain")
        this: dict[str, float] = {}
        for side in sides:
            if side == "polled":
                with Poller(url) as poller:
                    done, wall = asyncio.run(_round(url, model, streams, tokens))
                latencies += poller.latencies
                server_ms += poller.server_ms
                polled_s += wall
                failures += poller.failures
            else:
                done, wall = asyncio.run(_round(url, model, streams, tokens))
            this[side] = done / wall
            rates[side].append(this[side])
        ratios.append(this["polled"] / this["plain"])
    p99 = _percentile(latencies, 0.99)
    return {
        "status_p99_ms": None if p99 is None else p99 * 1000.0,
        "status_poll_overhead": 1.0 - statistics.median(ratios),
        "status_p50_ms": (_percentile(latencies, 0.5) or 0.0) * 1000.0,
        "status_polls": len(latencies),
        "status_server_p99_ms": _percentile(server_ms, 0.99) or 0.0,
        # The share of the polled rounds' wall time the event loop spent answering polls.
        "status_server_share": sum(server_ms) / 1000.0 / polled_s if polled_s else 0.0,
        "status_poll_failures": failures,
        "tokens_per_s_plain": statistics.median(rates["plain"]),
        "tokens_per_s_polled": statistics.median(rates["polled"]),
        "round_ratios": [round(r, 4) for r in ratios],
        "streams": streams,
        "max_tokens": tokens,
        "rounds": rounds,
    }


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        local: LocalServer | None = None
        if args.url is None:
            model = args.model
            if model is None:
                from mlxserve.models.tiny.synthetic import make_model

                model = str(make_model(Path(tmp) / "llama-h64", "llama", seed=0, hidden=64))
            local = LocalServer(model, args.streams).__enter__()
        try:
            url = (args.url or (local.url if local else "")).rstrip("/")
            model_name = discover_model(url, None)
            figures = measure(url, model_name, args.streams, args.tokens, args.rounds)
            figures["server"] = url
        finally:
            if local is not None:
                local.__exit__()
    emit("status", figures, args.json)
    return 0
