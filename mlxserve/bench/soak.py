"""`mlxserve bench soak --minutes M --agents N`: agents for minutes against a real server.

A real `mlxserve serve` process (the tiny 4-bit DeepSeek-V4 by default, with its
pooled and compressed caches) on loopback. Each agent speaks one of the three
dialects (OpenAI chat, Anthropic Messages, OpenAI Responses) and runs
multi-turn tool sessions whose history grows each turn: whatever the random
model writes, the client appends a tool call and its result itself, as an agent
re-sends its conversation. Now and then an agent drops its stream at its
first token, or sends a request the server must refuse. Reported:

- `requests_ok`, `requests_failed` (the bad requests, each answered 4xx),
  `disconnects`, `unexpected_errors` (anything else that was not a clean answer);
- `hit_ratio`: turns after a session's first whose prompt reused a cached prefix;
- `ttft_p50`, `ttft_p99` (s);
- the server's resident memory, sampled every `--sample-every` seconds (30):
  `rss_start_mb`, `rss_warm_mb`, `rss_end_mb`, `rss_growth` (end over warm),
  `rss_slope_mb_per_min` (least-squares slope from the warm point on),
  `rss_longest_flat_min` (the longest stretch within 1% of its start) and the
  series itself, `rss_series_mb`.

The warm point is a third of the way in (so a 30-minute run is judged on its
last 20 minutes), or the moment the prefix cache first held
`--prefix-cache-entries` entries (`prefix_cache_filled_min`) if that is later:
growth up to the cache's cap is by design, growth after it is a leak. The
cache holds 16 entries by default here, against the server's 64; at 64 the
agents take longer to fill it, and the bench says when they did (-1: never).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mlxserve.bench.report import emit
from mlxserve.bench.rss_series import Sample, after, longest_flat_minutes, slope_mb_per_min

MODEL = "bench"  # the name `LocalServer` serves
TURNS_PER_SESSION = 6
MAX_TOKENS = 24
DISCONNECT_EVERY = 7
BAD_EVERY = 11
DIALECTS = ("chat", "messages", "responses")
ROUTES = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
RESPONSE_ENDS = ("response.completed", "response.incomplete")
PARAMETERS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


@dataclass
class Tally:
    ok: int = 0
    bad_sent: int = 0
    failed: int = 0
    disconnects: int = 0
    unexpected: list[str] = field(default_factory=list)
    later_turns: int = 0
    hits: int = 0
    ttfts: list[float] = field(default_factory=list)


@dataclass
class Session:
    """One agent conversation, kept in a neutral form and rendered per dialect."""

    system: str
    turns: list[tuple[str, str, str]] = field(default_factory=list)  # (call id, path, result)


def _rng_text(rng: random.Random, words: int) -> str:
    vocab = ("def", "return", "self", "value", "index", "for", "in", "if", "else", "None")
    return " ".join(rng.choice(vocab) + str(rng.randrange(100)) for _ in range(words))


def _chat_body(s: Session, question: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": s.system}]
    messages.append({"role": "user", "content": question})
    for call_id, path, result in s.turns:
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": path})},
        }
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    tool = {"type": "function", "function": {"name": "read_file", "parameters": PARAMETERS}}
    return {
        "model": MODEL,
        "messages": messages,
        "tools": [tool],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _messages_body(s: Session, question: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for call_id, path, result in s.turns:
        use = {"type": "tool_use", "id": call_id, "name": "read_file", "input": {"path": path}}
        messages.append({"role": "assistant", "content": [use]})
        back = {"type": "tool_result", "tool_use_id": call_id, "content": result}
        messages.append({"role": "user", "content": [back]})
    tool = {"name": "read_file", "description": "Read a file", "input_schema": PARAMETERS}
    return {
        "model": MODEL,
        "system": s.system,
        "messages": messages,
        "tools": [tool],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }


def _responses_body(s: Session, question: str) -> dict[str, Any]:
    items: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for call_id, path, result in s.turns:
        items.append(
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "read_file",
                "arguments": json.dumps({"path": path}),
            }
        )
        items.append({"type": "function_call_output", "call_id": call_id, "output": result})
    tool = {"type": "function", "name": "read_file", "parameters": PARAMETERS, "strict": False}
    return {
        "model": MODEL,
        "instructions": s.system,
        "input": items,
        "tools": [tool],
        "max_output_tokens": MAX_TOKENS,
        "stream": True,
        "store": False,
    }


BODIES = {"chat": _chat_body, "messages": _messages_body, "responses": _responses_body}


def _cached(dialect: str, event: dict[str, Any]) -> int | None:
    """Cached prompt tokens, where this event carries the usage."""
    if dialect == "chat":
        usage = event.get("usage") or {}
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if dialect == "messages":
        if event.get("type") == "message_delta":
            return (event.get("usage") or {}).get("cache_read_input_tokens")
        return None
    if event.get("type") in RESPONSE_ENDS:
        usage = event["response"].get("usage") or {}
        return (usage.get("input_tokens_details") or {}).get("cached_tokens")
    return None


def _carries_tokens(dialect: str, event: dict[str, Any]) -> bool:
    """Whether the event carries generated text (the first one's time is the TTFT)."""
    if dialect == "chat":
        delta = (event.get("choices") or [{}])[0].get("delta") or {}
        return bool(
            delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
        )
    return str(event.get("type", "")).endswith("_delta" if dialect == "messages" else ".delta")


def _is_error(dialect: str, event: dict[str, Any]) -> bool:
    kind = str(event.get("type", ""))
    return "error" in event if dialect == "chat" else kind in ("error", "response.failed")


async def _turn(
    http: httpx.AsyncClient, dialect: str, body: dict[str, Any], drop: bool, tally: Tally
) -> int | None:
    """Stream one request; its cached tokens (None: it did not end cleanly)."""
    start = time.perf_counter()
    first, cached, clean = True, None, False
    async with http.stream("POST", ROUTES[dialect], json=body) as response:
        if response.status_code != 200:
            tally.unexpected.append(f"{dialect}: HTTP {response.status_code}")
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                clean = clean or line == "data: [DONE]"
                continue
            event = json.loads(line[6:])
            if first and _carries_tokens(dialect, event):
                tally.ttfts.append(time.perf_counter() - start)
                first = False
                if drop:
                    tally.disconnects += 1
                    return None  # leaving the block closes the connection mid-stream
            if _is_error(dialect, event):
                tally.unexpected.append(f"{dialect}: {json.dumps(event)[:200]}")
                return None
            found = _cached(dialect, event)
            cached = found if found is not None else cached
            clean = clean or event.get("type") in ("message_stop", *RESPONSE_ENDS)
    if not clean or cached is None:
        tally.unexpected.append(f"{dialect}: the stream ended without its finish or usage")
        return None
    tally.ok += 1
    return cached


async def _bad(http: httpx.AsyncClient, dialect: str, tally: Tally) -> None:
    """A request the server must refuse with a 4xx in its route's shape."""
    tally.bad_sent += 1
    body = {"model": MODEL, "max_tokens": -3, "max_output_tokens": -3, "messages": "nope"}
    response = await http.post(ROUTES[dialect], json=body)
    if 400 <= response.status_code < 500 and "error" in response.json():
        tally.failed += 1
    else:
        tally.unexpected.append(f"{dialect}: a bad request got HTTP {response.status_code}")


async def _agent(index: int, url: str, deadline: float, tally: Tally) -> None:
    rng = random.Random(index)
    dialect = DIALECTS[index % len(DIALECTS)]
    turn_number = 0
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < deadline:
            session = Session(f"You are agent {index}. Project notes: {_rng_text(rng, 120)}")
            question = f"Fix the bug in module {rng.randrange(1000)}."
            for turn in range(TURNS_PER_SESSION):
                if time.monotonic() >= deadline:
                    return
                turn_number += 1
                if turn_number % BAD_EVERY == 0:
                    await _bad(http, dialect, tally)
                drop = turn_number % DISCONNECT_EVERY == 0
                body = BODIES[dialect](session, question)
                try:
                    cached = await _turn(http, dialect, body, drop, tally)
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    tally.unexpected.append(f"{dialect}: {type(e).__name__}: {e}")
                    cached = None
                if turn > 0 and cached is not None:
                    tally.later_turns += 1
                    tally.hits += cached > 0
                call_id = f"call_{index}_{turn_number}"
                session.turns.append((call_id, f"src/m{turn}.py", _rng_text(rng, 60)))


def _cache_stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(url + "/v1/cache/stats", timeout=30).json()
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("mlx_active_bytes", "mlx_cache_bytes"):
            if line.startswith(f"mlxserve_{name}{{"):
                stats[name] = float(line.split()[1])
    return stats


def _rss_mb(pid: int) -> float:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) / 1024


@dataclass
class MemorySeries:
    """The server's resident memory and prefix-cache fill, sampled while agents run."""

    capacity: int  # the prefix cache's entries when full
    rss: list[Sample] = field(default_factory=list)
    filled_min: float | None = None  # when the prefix cache first held `capacity` entries

    async def sample_until(
        self, url: str, pid: int, started: float, every_s: float, done: asyncio.Event
    ) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while True:
                minute = (time.monotonic() - started) / 60
                self.rss.append((minute, _rss_mb(pid)))
                entries = (await http.get("/v1/cache/stats")).json().get("entries", 0)
                if self.filled_min is None and entries >= self.capacity:
                    self.filled_min = minute
                try:
                    await asyncio.wait_for(done.wait(), timeout=every_s)
                    return
                except TimeoutError:
                    continue

    def figures(self, minutes: float) -> dict[str, Any]:
        """Growth and slope from the warm point: a third of the way in (so the last
        two thirds, 20 minutes of a 30-minute run, are judged), or once the prefix
        cache has filled if that is later (its growth up to its cap is by design)."""
        warm = max(minutes / 3, self.filled_min if self.filled_min is not None else 0.0)
        judged = after(self.rss, warm) or self.rss[-1:]
        return {
            "rss_samples": len(self.rss),
            "prefix_cache_filled_min": self.filled_min if self.filled_min is not None else -1,
            "warm_min": warm,
            "rss_warm_mb": judged[0][1],
            "rss_growth": self.rss[-1][1] / judged[0][1] if judged[0][1] else 0.0,
            "rss_slope_mb_per_min": slope_mb_per_min(judged),
            "rss_slope_window_min": judged[-1][0] - judged[0][0],
            "rss_longest_flat_min": longest_flat_minutes(self.rss),
            "rss_series_mb": [round(mb, 1) for _, mb in self.rss],
        }


async def _drive(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    series = MemorySeries(capacity=args.prefix_cache_entries)
    started = time.monotonic()
    deadline = started + args.minutes * 60
    done = asyncio.Event()
    sampler = asyncio.create_task(series.sample_until(url, pid, started, args.sample_every, done))
    agents = [asyncio.create_task(_agent(i, url, deadline, tally)) for i in range(args.agents)]
    await asyncio.sleep(args.minutes * 60 / 3)
    cache_warm = _cache_stats(url)
    await asyncio.gather(*agents)
    done.set()
    await sampler
    series.rss.append(((time.monotonic() - started) / 60, _rss_mb(pid)))
    cache_end = _cache_stats(url)
    ttfts = sorted(tally.ttfts) or [0.0]
    return {
        "minutes": args.minutes,
        "agents": args.agents,
        "requests_ok": tally.ok,
        "requests_failed": tally.failed,
        "bad_requests_sent": tally.bad_sent,
        "disconnects": tally.disconnects,
        "unexpected_errors": len(tally.unexpected),
        "unexpected_examples": tally.unexpected[:5],
        "hit_ratio": tally.hits / tally.later_turns if tally.later_turns else 0.0,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "rss_start_mb": series.rss[0][1],
        "rss_end_mb": series.rss[-1][1],
        **series.figures(args.minutes),
        # What the bounded caches held then: growth there is a cache filling up.
        "prefix_cache_entries_warm": cache_warm.get("entries", 0),
        "prefix_cache_entries_end": cache_end.get("entries", 0),
        "prefix_cache_mb_warm": cache_warm.get("bytes", 0) / 2**20,
        "prefix_cache_mb_end": cache_end.get("bytes", 0) / 2**20,
        "mlx_active_mb_warm": cache_warm.get("mlx_active_bytes", 0) / 2**20,
        "mlx_active_mb_end": cache_end.get("mlx_active_bytes", 0) / 2**20,
        "mlx_cache_mb_warm": cache_warm.get("mlx_cache_bytes", 0) / 2**20,
        "mlx_cache_mb_end": cache_end.get("mlx_cache_bytes", 0) / 2**20,
    }


def run(args: argparse.Namespace) -> int:
    from mlxserve.bench.disk_cache import quantized_tiny
    from mlxserve.bench.serve import LocalServer

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else quantized_tiny("deepseek_v4", Path(tmp))
        cache = ("--prefix-cache-entries", str(args.prefix_cache_entries))
        with LocalServer(str(model), max_num_seqs=8, extra_args=cache) as server:
            assert server.process is not None
            figures = asyncio.run(_drive(server.url, server.process.pid, args))
    emit("soak", figures, args.json)
    return 0
