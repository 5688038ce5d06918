"""The output parser chain the server runs per request.

decoded delta ─► strip end-of-sequence text ─► reasoning parser
              ─► (its content) ─► tool parser ─► events

Reasoning events pass straight through; content events of the reasoning
parser are fed to the tool parser, whose events (content and tool calls)
come out in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxserve.parsers.events import ContentDelta, ParserEvent, StreamParser
from mlxserve.parsers.textscan import StringStripper


class OutputParser:
    """One request's parser chain: `feed(delta)` per decoded delta, then `finish()`."""

    def __init__(
        self,
        reasoning: StreamParser,
        tool: StreamParser | None = None,
        strip: Sequence[str] = (),
    ) -> None:
        self._stripper = StringStripper(strip)
        self._reasoning = reasoning
        self._tool = tool
        self._finished = False

    def feed(self, delta: str) -> list[ParserEvent]:
        if self._finished:
            raise RuntimeError("OutputParser.feed() after finish()")
        text = self._stripper.feed(delta)
        if not text:
            return []
        return self._route(self._reasoning.feed(text))

    def finish(self) -> list[ParserEvent]:
        if self._finished:
            return []
        self._finished = True
        events = self._reasoning.feed(self._stripper.finish())
        events += self._reasoning.finish()
        out = self._route(events)
        if self._tool is not None:
            out += self._tool.finish()
        return _merge(out)

    def _route(self, events: list[ParserEvent]) -> list[ParserEvent]:
        tool = self._tool
        if tool is None:
            return events
        out: list[ParserEvent] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out += tool.feed(event.text)
            else:
                out.append(event)
        return out


def _merge(events: list[ParserEvent]) -> list[ParserEvent]:
    """Join adjacent content deltas (finish() may produce several)."""
    out: list[ParserEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + event.text)
        else:
            out.append(event)
    return out
