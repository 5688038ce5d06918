"""Shared machinery of the tool-call parsers: content text with embedded blocks.

Outside a block, text is content, except a tail that could still grow into
an opening marker (plus the `lead` that belongs to the block, e.g. DSML's
blank line), which is held back. From an opening marker on, text goes to a
format-specific `BlockScanner` and is buffered until the block closes and
validates; only then are tool-call events emitted. A block that turns out
malformed is given back as content verbatim: its opening is emitted as
content and the rest is scanned again as ordinary text (it may hold a later
block). A block still open at `finish()` is content too. Nothing is dropped.
"""

from __future__ import annotations

import enum
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from mlxserve.parsers.events import (
    ContentDelta,
    ParserEvent,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)
from mlxserve.parsers.textscan import find_first, held_tail_len, lead_start


class Status(enum.Enum):
    MORE = "more"  # the block is still open: feed more text
    DONE = "done"  # the block closed and validated: read `calls` and `remainder()`
    BAD = "bad"  # the block is malformed: give `raw_text()` back as content


ToolCall = tuple[str, dict[str, Any]]


class BlockScanner(ABC):
    """Scans one block's text (everything after its opening marker).

    Keeps what was fed (for `raw_text`) and the unscanned tail `_buf[_pos:]`.
    """

    calls: list[ToolCall]

    def __init__(self) -> None:
        self._fed: list[str] = []
        self._buf = ""
        self._pos = 0
        self.calls = []

    @abstractmethod
    def feed(self, text: str) -> Status:
        """Consume more of the block; cheap in the size of `text`."""

    def _take(self, text: str) -> None:
        """Record `text` and drop the already-scanned part of the buffer."""
        self._fed.append(text)
        self._buf = self._buf[self._pos :] + text
        self._pos = 0

    def raw_text(self) -> str:
        """Everything fed so far, verbatim."""
        return "".join(self._fed)

    def remainder(self) -> str:
        """After DONE: text fed beyond the closing marker."""
        return self._buf[self._pos :]


def call_events(index: int, name: str, arguments: dict[str, Any]) -> list[ParserEvent]:
    """The start / arguments / end events of one complete tool call."""
    call_id = new_call_id()
    return [
        ToolCallStart(index=index, id=call_id, name=name),
        ToolCallArgs(index=index, arguments=json.dumps(arguments, ensure_ascii=False)),
        ToolCallEnd(index=index, arguments=arguments, id=call_id, name=name),
    ]


class BlockToolParser(ABC):
    """Streaming tool-call parser over content text; one instance per request."""

    def __init__(self, openers: Sequence[str], lead: str = "") -> None:
        self._openers = tuple(openers)
        self._lead = lead
        self._buf = ""  # content text not yet emitted (held tail, or text to rescan)
        self._scanner: BlockScanner | None = None
        self._head = ""  # lead + opening marker of the open block
        self._next_index = 0

    @property
    def openers(self) -> tuple[str, ...]:
        return self._openers

    @property
    def lead(self) -> str:
        return self._lead

    @abstractmethod
    def _new_scanner(self, opener: str) -> BlockScanner:
        """A scanner for the block that `opener` just opened."""

    def feed(self, delta: str) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        if self._scanner is not None:
            self._after_block(self._scanner.feed(delta), events)
        else:
            self._buf += delta
        while self._scanner is None and self._buf:
            if not self._scan_text(events):
                break
        return events

    def finish(self) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        text = self._buf
        if self._scanner is not None:
            text = self._head + self._scanner.raw_text()
        self._buf, self._scanner, self._head = "", None, ""
        if text:
            events.append(ContentDelta(text))
        return events

    def _scan_text(self, events: list[ParserEvent]) -> bool:
        """Emit content up to the next block; True if a block was opened."""
        text = self._buf
        found = find_first(text, self._openers)
        if found is None:
            hold = held_tail_len(text, self._openers, self._lead)
            if len(text) > hold:
                events.append(ContentDelta(text[: len(text) - hold]))
            self._buf = text[len(text) - hold :]
            return False
        pos, opener = found
        cut = lead_start(text, pos, self._lead)
        if cut:
            events.append(ContentDelta(text[:cut]))
        end = pos + len(opener)
        self._head = text[cut:end]
        self._buf = ""
        self._scanner = self._new_scanner(opener)
        self._after_block(self._scanner.feed(text[end:]), events)
        return True

    def _after_block(self, status: Status, events: list[ParserEvent]) -> None:
        scanner = self._scanner
        if scanner is None or status is Status.MORE:
            return
        if status is Status.DONE:
            for name, arguments in scanner.calls:
                events.extend(call_events(self._next_index, name, arguments))
                self._next_index += 1
            self._buf = scanner.remainder()
        else:
            events.append(ContentDelta(self._head))
            self._buf = scanner.raw_text()
        self._scanner, self._head = None, ""
