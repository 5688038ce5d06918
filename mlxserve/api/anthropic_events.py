"""The output pipeline's deltas -> Anthropic Messages events and message (pure).

`MessageEvents` is one response's state machine: it opens a content block
when the kind of output changes (thinking, text, tool_use), sends each
delta as that block's delta event, and closes blocks in order; `finish`
closes the message. `message_body` folds the same output into the
non-streaming message. Neither touches HTTP or the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxserve.api.pipeline import Accumulator, OutputDelta, Usage
from mlxserve.api.sealed import seal_reasoning

Event = tuple[str, dict[str, Any]]

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


@dataclass(frozen=True)
class MessageMeta:
    id: str
    model: str
    show_thinking: bool = True


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


def tool_use_id(call_id: str) -> str:
    """Anthropic spells tool-use ids `toolu_…`."""
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


def usage_body(usage: Usage) -> dict[str, int]:
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.completion_tokens,
    }


def sse_event(event: Event) -> bytes:
    name, data = event
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


PING: Event = ("ping", {"type": "ping"})


def error_event(message: str, kind: str = "api_error") -> Event:
    return ("error", {"type": "error", "error": {"type": kind, "message": message}})


class MessageEvents:
    """Anthropic stream events for one response, fed the pipeline's deltas in order."""

    def __init__(self, meta: MessageMeta) -> None:
        self.meta = meta
        self._index = -1
        self._open: str | None = None  # the kind of the open block
        self._reasoning: list[str] = []
        self._pending_space = ""  # whitespace-only text not yet worth a text block
        self._had_tool = False

    def start(self, usage: Usage) -> list[Event]:
        message: dict[str, Any] = {
            "id": self.meta.id,
            "type": "message",
            "role": "assistant",
            "model": self.meta.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_body(usage),
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def delta(self, delta: OutputDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._thinking(delta.reasoning)
        if delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls:
            if call.id is not None or call.name is not None:
                self._had_tool = True
                events += self._open_block("tool_use", _tool_use_block(call.id, call.name))
            if call.arguments:
                json_delta = {"type": "input_json_delta", "partial_json": call.arguments}
                events.append(self._delta_event(json_delta))
        return events

    def finish(
        self, finish_reason: str | None, stop_sequence: str | None, usage: Usage
    ) -> list[Event]:
        events: list[Event] = []
        if self._pending_space and not self._had_tool:
            events += self._text("", force=True)
        events += self._close()
        if self._index < 0:
            # Every message has at least one block, even an empty answer.
            events += self._open_block("text", {"type": "text", "text": ""}) + self._close()
        delta = {
            "stop_reason": stop_reason(finish_reason, stop_sequence),
            "stop_sequence": stop_sequence,
        }
        events.append(
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_body(usage)})
        )
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _thinking(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open != "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
            events += self._open_block("thinking", block)
        self._reasoning.append(text)
        if self.meta.show_thinking:
            events.append(self._delta_event({"type": "thinking_delta", "thinking": text}))
        return events

    def _text(self, text: str, force: bool = False) -> list[Event]:
        if self._open != "text" and not text.strip() and not force:
            self._pending_space += text
            return []
        events: list[Event] = []
        if self._open != "text":
            events += self._open_block("text", {"type": "text", "text": ""})
        text, self._pending_space = self._pending_space + text, ""
        events.append(self._delta_event({"type": "text_delta", "text": text}))
        return events

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self._index += 1
        self._open = kind
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return [*events, ("content_block_start", start)]

    def _delta_event(self, delta: dict[str, Any]) -> Event:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": delta},
        )

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        events: list[Event] = []
        if self._open == "thinking":
            signature = seal_reasoning("".join(self._reasoning))
            self._reasoning = []
            events.append(self._delta_event({"type": "signature_delta", "signature": signature}))
        self._open = None
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        return events


def _tool_use_block(call_id: str | None, name: str | None) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call_id or ""), "name": name or "", "input": {}}


def message_body(
    meta: MessageMeta, acc: Accumulator, usage: Usage, stop_sequence: str | None
) -> dict[str, Any]:
    """The non-streaming Messages response: the blocks a stream of it ends with."""
    content: list[dict[str, Any]] = []
    for run in acc.in_order():
        if run.reasoning:
            shown = run.reasoning if meta.show_thinking else ""
            signature = seal_reasoning(run.reasoning)
            content.append({"type": "thinking", "thinking": shown, "signature": signature})
        elif run.content.strip() or (run.content and not acc.calls):
            content.append({"type": "text", "text": run.content})
        for call in run.tool_calls:
            block = _tool_use_block(call.id, call.name)
            block["input"] = json.loads(call.arguments or "{}")
            content.append(block)
    if not content:
        content.append({"type": "text", "text": ""})
    return {
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": stop_reason(acc.finish_reason, stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": usage_body(usage),
    }
