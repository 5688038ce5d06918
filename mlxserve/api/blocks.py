"""The block sequencer both block-structured dialects share (Anthropic, Responses).

The pipeline's deltas are a flat stream of reasoning, text and tool-call
pieces; Anthropic content blocks and Responses output items are the same
stream cut into blocks. `BlockSequencer` makes the cuts once: a block opens
when the kind of output changes (or a new call starts), its pieces are
appended, and it closes before the next one opens or at the end. It also
holds back whitespace-only text until real text follows (a model's blank
line before a tool call is not worth a block), and sends it at the end
only when no call was made. A dialect supplies the three hooks that turn
these steps into its own events.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

from mlxserve.api.pipeline import OutputDelta, ToolCallDelta

E = TypeVar("E")

REASONING, TEXT, CALL = "reasoning", "text", "call"


class BlockSequencer(ABC, Generic[E]):
    """Deltas in order -> a dialect's block events, via `open_block`, `append`, `close_block`."""

    def __init__(self) -> None:
        self.open_kind: str | None = None
        self._block_text: list[str] = []
        self._reasoning: list[str] = []
        self._pending_space = ""
        self._had_call = False

    @property
    def reasoning_text(self) -> str:
        """All reasoning so far, across blocks."""
        return "".join(self._reasoning)

    def feed(self, delta: OutputDelta) -> list[E]:
        events: list[E] = []
        if delta.reasoning:
            events += self._piece(REASONING, delta.reasoning)
            self._reasoning.append(delta.reasoning)
        if delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls:
            if call.id is not None or call.name is not None:
                self._had_call = True
                events += self._switch(CALL, call)
            if call.arguments and self.open_kind == CALL:
                self._block_text.append(call.arguments)
                events += self.append(CALL, call.arguments)
        return events

    def end(self) -> list[E]:
        """Flush held-back whitespace (when no call was made) and close the open block."""
        events: list[E] = []
        if self._pending_space and not self._had_call:
            events += self._text("", force=True)
        return events + self._close()

    def _piece(self, kind: str, text: str) -> list[E]:
        events = self._switch(kind) if self.open_kind != kind else []
        self._block_text.append(text)
        return events + self.append(kind, text)

    def _text(self, text: str, force: bool = False) -> list[E]:
        if self.open_kind != TEXT and not text.strip() and not force:
            self._pending_space += text
            return []
        text, self._pending_space = self._pending_space + text, ""
        return self._piece(TEXT, text)

    def _switch(self, kind: str, call: ToolCallDelta | None = None) -> list[E]:
        events = self._close()
        self.open_kind = kind
        return events + self.open_block(kind, call)

    def _close(self) -> list[E]:
        kind, self.open_kind = self.open_kind, None
        if kind is None:
            return []
        text, self._block_text = "".join(self._block_text), []
        return self.close_block(kind, text)

    @abstractmethod
    def open_block(self, kind: str, call: ToolCallDelta | None) -> list[E]:
        """Events that open a block of `kind` (`call`: the call's first delta)."""

    @abstractmethod
    def append(self, kind: str, text: str) -> list[E]:
        """Events for a piece of the open block (reasoning, text or call arguments)."""

    @abstractmethod
    def close_block(self, kind: str, text: str) -> list[E]:
        """Events that close the open block; `text` is all that was appended to it."""
