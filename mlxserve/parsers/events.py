"""Typed events emitted by the streaming output parsers, and the parser protocol."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """A piece of reasoning (thinking) text."""

    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """A piece of visible content text."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call begins: `index` counts calls within one response, from 0."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgs:
    """A fragment of the call's arguments as JSON text (fragments concatenate)."""

    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """A tool call is complete; `arguments` is the decoded arguments object."""

    index: int
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    name: str = ""


ParserEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgs | ToolCallEnd


class StreamParser(Protocol):
    """One request's parser state: fed decoded text deltas, flushed at the end."""

    def feed(self, delta: str) -> list[ParserEvent]: ...

    def finish(self) -> list[ParserEvent]: ...


def new_call_id() -> str:
    """A fresh tool-call id: `call_` + 24 random hex digits."""
    return "call_" + secrets.token_hex(12)
