"""Shared machinery of the tool-call parsers: content text with embedded blocks.

Outside a block, text is content, except a tail that could still grow into
an opening marker (plus the `lead` that belongs to the block, e.g. DSML's
blank line), which is held back. From an opening marker on, text goes to a
format-specific `BlockScanner`. A call is streamed as it is generated: a
`ToolCallStart` once its name is known, then `ToolCallArgs` fragments of its
JSON arguments, and a `ToolCallEnd` when the block closes and validates. A
block that turns out malformed is given back as content verbatim: each call
of it already streamed gets a `ToolCallDiscard`, its opening is emitted as
content and the rest is scanned again as ordinary text (it may hold a later
block). A block still open at `finish()` is content too. Nothing is dropped.
"""

from __future__ import annotations

import enum
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from mlxserve.parsers.events import (
    ContentDelta,
    ParserEvent,
    ToolCallArgs,
    ToolCallDiscard,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)
from mlxserve.parsers.textscan import find_first, held_tail_len, lead_start


def strict_json_loads(text: str) -> Any:
    """`json.loads` of standard JSON only. NaN, Infinity and numbers past the
    float range (`1e400`) are errors: they would go out as `NaN` / `Infinity`,
    which JavaScript's `JSON.parse` and strict encoders refuse."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite_float)


def _not_json(name: str) -> Any:
    raise ValueError(f"not JSON: {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text}")
    return value


class Status(enum.Enum):
    MORE = "more"  # the block is still open: feed more text
    DONE = "done"  # the block closed and validated: read `calls` and `remainder()`
    BAD = "bad"  # the block is malformed: give `raw_text()` back as content


ToolCall = tuple[str, dict[str, Any]]
# What a scanner streamed since it was last asked: (call number in the block,
# the call's name when it starts here, else None; a fragment of its arguments).
Progress = tuple[int, str | None, str]


class BlockScanner(ABC):
    """Scans one block's text (everything after its opening marker).

    Keeps what was fed (for `raw_text`) and the unscanned tail `_buf[_pos:]`.
    A scanner may stream calls as it reads them (`_start_call`, `_fragment`);
    a call it streamed must, when the block is DONE, be in `calls` at the same
    position, its fragments concatenating to its whole arguments text.
    """

    calls: list[ToolCall]

    def __init__(self) -> None:
        self._fed: list[str] = []
        self._buf = ""
        self._pos = 0
        self.calls = []
        self.streamed: list[list[str]] = []  # fragments of each call streamed so far
        self._progress: list[Progress] = []

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

    def _start_call(self, name: str) -> None:
        self.streamed.append([])
        self._progress.append((len(self.streamed) - 1, name, ""))

    def _fragment(self, text: str) -> None:
        """More arguments text of the call streamed last."""
        if text:
            self.streamed[-1].append(text)
            self._progress.append((len(self.streamed) - 1, None, text))

    def take_progress(self) -> list[Progress]:
        progress, self._progress = self._progress, []
        return progress


class BlockToolParser(ABC):
    """Streaming tool-call parser over content text; one instance per request."""

    def __init__(self, openers: Sequence[str], lead: str = "") -> None:
        self._openers = tuple(openers)
        self._lead = lead
        self._buf = ""  # content text not yet emitted (held tail, or text to rescan)
        self._scanner: BlockScanner | None = None
        self._head = ""  # lead + opening marker of the open block
        self._next_index = 0
        self._ids: list[str] = []  # ids of the open block's streamed calls

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
            self._stream(self._scanner, events)
            self._discard(events)
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

    def _stream(self, scanner: BlockScanner, events: list[ParserEvent]) -> None:
        """The starts and argument fragments the scanner read since the last call."""
        for number, name, fragment in scanner.take_progress():
            index = self._next_index + number
            if name is not None:
                self._ids.append(new_call_id())
                events.append(ToolCallStart(index=index, id=self._ids[number], name=name))
            if not fragment:
                continue
            last = events[-1] if events else None
            if isinstance(last, ToolCallArgs) and last.index == index:
                events[-1] = ToolCallArgs(index=index, arguments=last.arguments + fragment)
            else:
                events.append(ToolCallArgs(index=index, arguments=fragment))

    def _discard(self, events: list[ParserEvent]) -> None:
        """Void the open block's streamed calls; their indices are not reused."""
        for number in range(len(self._ids)):
            events.append(ToolCallDiscard(self._next_index + number))
        self._next_index += len(self._ids)
        self._ids = []

    def _after_block(self, status: Status, events: list[ParserEvent]) -> None:
        scanner = self._scanner
        if scanner is None:
            return
        self._stream(scanner, events)
        if status is Status.MORE:
            return
        if status is Status.DONE:
            self._end_calls(scanner, events)
            self._buf = scanner.remainder()
        else:
            self._discard(events)
            events.append(ContentDelta(self._head))
            self._buf = scanner.raw_text()
        self._scanner, self._head = None, ""

    def _end_calls(self, scanner: BlockScanner, events: list[ParserEvent]) -> None:
        for number, (name, arguments) in enumerate(scanner.calls):
            index = self._next_index + number
            if number < len(self._ids):
                call_id, text = self._ids[number], "".join(scanner.streamed[number])
            else:  # a call the scanner could not stream: all of it now
                call_id, text = new_call_id(), json.dumps(arguments, ensure_ascii=False)
                events.append(ToolCallStart(index=index, id=call_id, name=name))
                events.append(ToolCallArgs(index=index, arguments=text))
            events.append(
                ToolCallEnd(
                    index=index, arguments=arguments, id=call_id, name=name, arguments_json=text
                )
            )
        self._next_index += len(scanner.calls)
        self._ids = []
