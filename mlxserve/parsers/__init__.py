"""parsers stage (see docs/architecture.md): streaming output parsers.

The server uses `resolve_parsers(...) -> ParserSpec`, `ParserSpec.create(...)
-> OutputParser` and the event classes; `parse_stream` is the one-call
helper (streaming and whole-text parsing are the same state machine).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mlxserve.parsers.chain import OutputParser
from mlxserve.parsers.events import (
    ContentDelta,
    ParserEvent,
    ReasoningDelta,
    StreamParser,
    ToolCallArgs,
    ToolCallDiscard,
    ToolCallEnd,
    ToolCallStart,
)
from mlxserve.parsers.registry import (
    PRESETS,
    REASONING_PARSERS,
    TOOL_PARSERS,
    ParserSpec,
    preset,
    resolve_parsers,
)

__all__ = [
    "PRESETS",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ContentDelta",
    "OutputParser",
    "ParserEvent",
    "ParserSpec",
    "ReasoningDelta",
    "StreamParser",
    "ToolCallArgs",
    "ToolCallDiscard",
    "ToolCallEnd",
    "ToolCallStart",
    "accumulate",
    "parse_stream",
    "preset",
    "resolve_parsers",
]


def accumulate(events: Iterable[ParserEvent]) -> dict[str, Any]:
    """Fold events into `{"reasoning_content", "content", "tool_calls"}` (empty -> None)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = {"name": event.name, "arguments": {}}
        elif isinstance(event, ToolCallEnd):
            calls.setdefault(event.index, {"name": event.name, "arguments": {}})
            calls[event.index]["arguments"] = event.arguments
        elif isinstance(event, ToolCallDiscard):
            calls.pop(event.index, None)
    return {
        "reasoning_content": "".join(reasoning) or None,
        "content": "".join(content) or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
    }


def parse_stream(
    deltas: Iterable[str],
    *,
    parser: str = "deepseek_v4",
    thinking: bool,
    tools_given: bool,
) -> dict[str, Any]:
    """Feed `deltas` through a fresh parser chain and accumulate what it emitted.

    `parser` names a preset (`deepseek_v4`, `deepseek_v41`, `qwen3`,
    `deepseek_r1`, `hermes`, `none`). Returns `{"reasoning_content": str |
    None, "content": str | None, "tool_calls": [{"name", "arguments"}]}`.
    """
    chain = preset(parser).create(thinking=thinking, tools_given=tools_given)
    events: list[ParserEvent] = []
    for delta in deltas:
        events += chain.feed(delta)
    events += chain.finish()
    return accumulate(events)
