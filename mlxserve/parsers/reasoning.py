"""Reasoning parsers: split `<think>…</think>` reasoning from content.

One state machine serves DeepSeek-V4/V4.1, DeepSeek-R1 and Qwen3: in
thinking mode output starts inside reasoning (the prompt already opened it;
a leading `<think>` is tolerated and dropped) and `</think>` ends it. A
tool parser's opening marker may also end reasoning ("hand-off"): then the
marker, with the `lead` text just before it (DeepSeek-V4: the blank line),
goes to content, where the tool parser picks it up. In chat mode
(`thinking=False`) everything is content.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxserve.parsers.events import ContentDelta, ParserEvent, ReasoningDelta
from mlxserve.parsers.textscan import find_first, held_tail_len, lead_start

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True, slots=True)
class Handoff:
    """Markers that end reasoning and belong to content (with `lead` before them)."""

    openers: tuple[str, ...]
    lead: str = ""


class PassthroughParser:
    """Everything is content (chat mode, or no reasoning parser)."""

    def feed(self, delta: str) -> list[ParserEvent]:
        return [ContentDelta(delta)] if delta else []

    def finish(self) -> list[ParserEvent]:
        return []


class ThinkReasoningParser:
    """Streaming `<think>` reasoning splitter; one instance per request."""

    def __init__(self, thinking: bool = True, handoff: Handoff | None = None) -> None:
        self._handoff = handoff or Handoff(())
        self._markers: Sequence[str] = (THINK_CLOSE, *self._handoff.openers)
        self._state = "start" if thinking else "content"
        self._buf = ""

    def feed(self, delta: str) -> list[ParserEvent]:
        if self._state == "content":
            return [ContentDelta(delta)] if delta else []
        text = self._buf + delta
        self._buf = ""
        if self._state == "start":
            if text.startswith(THINK_OPEN):
                text = text[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(text):
                self._buf = text
                return []
            self._state = "reasoning"
        return self._scan(text)

    def finish(self) -> list[ParserEvent]:
        text, self._buf = self._buf, ""
        if self._state == "content" or not text:
            return [ContentDelta(text)] if text else []
        return [ReasoningDelta(text)]

    def _scan(self, text: str) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        found = find_first(text, self._markers)
        if found is None:
            hold = held_tail_len(text, self._markers, self._handoff.lead)
            emit = text[: len(text) - hold]
            self._buf = text[len(emit) :]
            if emit:
                events.append(ReasoningDelta(emit))
            return events
        pos, marker = found
        self._state = "content"
        if marker == THINK_CLOSE:
            reasoning, content = text[:pos], text[pos + len(THINK_CLOSE) :]
        else:
            cut = lead_start(text, pos, self._handoff.lead)
            reasoning, content = text[:cut], text[cut:]
        if reasoning:
            events.append(ReasoningDelta(reasoning))
        if content:
            events.append(ContentDelta(content))
        return events
