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
    """A tool call is complete and valid; `arguments` is the decoded arguments object.

    `arguments_json` is the call's whole arguments text: exactly the concatenation
    of its `ToolCallArgs` fragments.
    """

    index: int
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    name: str = ""
    arguments_json: str = ""


@dataclass(frozen=True, slots=True)
class ToolCallDiscard:
    """A call that was streamed as it was generated turned out malformed or cut off.

    Its block is given back as content (a `ContentDelta` follows); the call
    and its fragments are void, and its index is not used again.
    """

    index: int


ParserEvent = (
    ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgs | ToolCallEnd | ToolCallDiscard
)


class StreamParser(Protocol):
    """One request's parser state: fed decoded text deltas, flushed at the end."""

    def feed(self, delta: str) -> list[ParserEvent]: ...

    def finish(self) -> list[ParserEvent]: ...


def new_call_id() -> str:
    """A fresh tool-call id: `call_` + 24 random hex digits."""
    return "call_" + secrets.token_hex(12)
