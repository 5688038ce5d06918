"""`mlxserve bench encoder`: DeepSeek-V4 prompt encoder time per request.

Two agentic conversations with tools and tool calls: 4 messages and 130
messages. Each is encoded many times; the figure is the median over repeats
of the mean time per `encode_request` call, in milliseconds. The vllm-mlx
published figures are reported alongside for context (another machine, so
compare orders of magnitude, not digits).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from mlxserve.bench.report import emit
from mlxserve.chat.deepseek_v4 import encode_request

REFERENCE_MS_4 = 0.022
REFERENCE_MS_130 = 0.335

_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                "required": ["command"],
            },
        },
    },
]


def _round(n: int) -> list[dict[str, Any]]:
    """One agentic round: user asks, assistant reasons and calls a tool, tool answers."""
    call_id = f"call_{n}"
    return [
        {"role": "user", "content": f"Step {n}: check the weather and list the files."},
        {
            "role": "assistant",
            "reasoning_content": f"Round {n}: I should call the weather tool first.",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": f'{{"city": "Paris", "unit": "celsius", "day": {n}}}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": f'{{"temp": {n % 30}, "sky": "sun"}}'},
    ]


def conversation(n_messages: int) -> dict[str, Any]:
    """A request of exactly `n_messages` messages (system first, then rounds)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful agent."}]
    n = 0
    while len(messages) < n_messages:
        messages.extend(_round(n))
        n += 1
    return {
        "messages": messages[:n_messages],
        "tools": _TOOLS,
        "thinking": True,
        "reasoning_effort": "high",
    }


def time_ms(request: dict[str, Any], repeats: int = 7, min_seconds: float = 0.2) -> float:
    """Median over `repeats` of the mean milliseconds per encode_request call."""
    encode_request(request)  # warm up (and fail early on a bad request)
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            encode_request(request)
        if time.perf_counter() - start >= min_seconds / repeats or calls >= 1 << 20:
            break
        calls *= 2
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            encode_request(request)
        samples.append((time.perf_counter() - start) * 1000.0 / calls)
    return statistics.median(samples)


def run(args: argparse.Namespace) -> int:
    small, large = conversation(4), conversation(130)
    figures: dict[str, Any] = {
        "ms_4_messages": time_ms(small),
        "ms_130_messages": time_ms(large),
        "prompt_chars_4_messages": len(encode_request(small)),
        "prompt_chars_130_messages": len(encode_request(large)),
        "reference_ms_4_messages": REFERENCE_MS_4,
        "reference_ms_130_messages": REFERENCE_MS_130,
    }
    emit("encoder", figures, getattr(args, "json", None))
    return 0
