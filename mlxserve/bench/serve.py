"""`mlxserve bench serve`: HTTP streaming load test, optionally side by side with another server.

For each concurrency level, `--requests-per-level` streaming chat requests
run with at most that many in flight. Per request: TTFT (first content or
reasoning delta), TPOT ((last token time - first) / (tokens - 1)) and
tokens (the usage the server reports, else the number of deltas).
Per level: TTFT p50/p95, TPOT mean/p50 and aggregate tokens/s (all
tokens / wall time). With `--compare URL` the identical workload runs
against the other OpenAI-compatible server in the same run, level by level
(ours, then theirs), and the ratios are printed (tokens/s: ours / theirs,
TTFT and TPOT: theirs / ours, so > 1 means we are better).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mlxserve.bench.launcher import free_loopback_ports
from mlxserve.bench.report import emit

TOPICS = ("rivers", "bridges", "owls", "glaciers", "ciphers", "lanterns", "orchards", "comets")


@dataclass
class RequestResult:
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    latency: float = 0.0
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    wall: float
    results: list[RequestResult] = field(default_factory=list)


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    model: str


def workload(n: int) -> list[list[dict[str, str]]]:
    """The same deterministic prompts for every server."""
    return [
        [{"role": "user", "content": f"Request {i}: write a short note about {TOPICS[i % 8]}."}]
        for i in range(n)
    ]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def one_request(
    client: httpx.AsyncClient, target: Target, messages: list[dict[str, str]], max_tokens: int
) -> RequestResult:
    body = {
        "model": target.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = time.perf_counter()
    stamps: list[float] = []
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", f"{target.url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if (
                        delta.get("content")
                        or delta.get("reasoning_content")
                        or delta.get("reasoning")
                    ):
                        stamps.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.tokens = usage_tokens if usage_tokens else len(stamps)
    if stamps:
        result.ttft = stamps[0] - start
        if result.tokens > 1:
            result.tpot = (stamps[-1] - stamps[0]) / (result.tokens - 1)
    return result


async def run_level(
    target: Target, concurrency: int, n_requests: int, max_tokens: int
) -> LevelResult:
    prompts = workload(n_requests)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def bounded(messages: list[dict[str, str]]) -> RequestResult:
            async with gate:
                return await one_request(client, target, messages, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - start
    return LevelResult(concurrency, wall, list(results))


def summarize(level: LevelResult) -> dict[str, Any]:
    ok = [r for r in level.results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(level.results),
        "errors": len(level.results) - len(ok),
        "tokens": tokens,
        "ttft_p50_ms": _ms(_percentile(ttfts, 0.5)),
        "ttft_p95_ms": _ms(_percentile(ttfts, 0.95)),
        "tpot_mean_ms": _ms(statistics.fmean(tpots) if tpots else None),
        "tpot_p50_ms": _ms(_percentile(tpots, 0.5)),
        "tokens_per_s": tokens / level.wall if level.wall > 0 else 0.0,
        "wall_s": level.wall,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """> 1 means ours is better: throughput ours/theirs, latencies theirs/ours."""

    def div(a: Any, b: Any) -> float | None:
        return a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None

    return {
        "tokens_per_s": div(ours["tokens_per_s"], theirs["tokens_per_s"]),
        "ttft_p50": div(theirs["ttft_p50_ms"], ours["ttft_p50_ms"]),
        "tpot_p50": div(theirs["tpot_p50_ms"], ours["tpot_p50_ms"]),
    }


class LocalServer:
    """`mlxserve serve` in a subprocess on a free loopback port (stopped on exit)."""

    def __init__(
        self, model: str | None, max_num_seqs: int, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.port = free_loopback_ports()
        self.url = f"http://127.0.0.1:{self.port}"
        source = ["--demo", "deepseek-v4"] if model is None else [model]
        self.command = [
            sys.executable, "-m", "mlxserve.cli", "serve", *source,
            "--port", str(self.port), "--served-model-name", "bench",
            "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", *extra_args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalServer:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(self.command, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.__exit__()
        raise TimeoutError("the server did not become ready in 600 s")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def discover_model(url: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    r = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{url} lists no models; pass the model name")
    return str(data[0]["id"])


def _levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--concurrency must be a comma-separated list of ints: {spec!r}") from e
    if not levels or any(c < 1 for c in levels):
        raise ValueError("--concurrency levels must be >= 1")
    return levels


def bench_targets(
    targets: list[Target], levels: list[int], n_requests: int, max_tokens: int
) -> dict[str, Any]:
    """Run every level against every target (interleaved); the figures, flat."""
    figures: dict[str, Any] = {"max_tokens": max_tokens, "requests_per_level": n_requests}
    for target in targets:  # warm-up: first-request costs are not the server's steady state
        asyncio.run(run_level(target, 1, 1, 2))
    for c in levels:
        per_target: dict[str, dict[str, Any]] = {}
        for target in targets:
            summary = summarize(asyncio.run(run_level(target, c, n_requests, max_tokens)))
            per_target[target.name] = summary
            prefix = f"c{c}" if target.name == "ours" else f"c{c}.{target.name}"
            for key, value in summary.items():
                figures[f"{prefix}.{key}"] = value
        if "compare" in per_target:
            for key, value in ratios(per_target["ours"], per_target["compare"]).items():
                figures[f"c{c}.ratio.{key}"] = value
    return figures


def run(args: argparse.Namespace) -> int:
    try:
        levels = _levels(args.concurrency)
    except ValueError as e:
        print(f"mlxserve bench serve: {e}", file=sys.stderr)
        return 2
    local: LocalServer | None = None
    if args.url is None:
        model = None if args.model is None else str(Path(args.model))
        local = LocalServer(model, max(levels)).__enter__()
    try:
        url = args.url or (local.url if local else "")
        targets = [Target("ours", url.rstrip("/"), discover_model(url, None))]
        if args.compare:
            compare = args.compare.rstrip("/")
            targets.append(Target("compare", compare, discover_model(compare, args.compare_model)))
        figures = bench_targets(targets, levels, args.requests_per_level, args.max_tokens)
        figures["server"] = url
        figures["compare_server"] = args.compare
    finally:
        if local is not None:
            local.__exit__()
    emit("serve", figures, args.json)
    return 0
