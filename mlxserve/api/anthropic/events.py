"""The output pipeline's deltas -> Anthropic Messages events and message (pure).

`MessageEvents` is one response's writer: the shared block sequencer cuts
the output into content blocks (thinking, text, tool_use), and this file
spells them as Anthropic events; `finish` closes the message. The
non-streaming message is the same machine fed the whole output, its events
folded into blocks the way a client folds the stream (`fold_message`), so
both paths give the same content. Nothing here touches HTTP or the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxserve.api.blocks import CALL, REASONING, BlockSequencer
from mlxserve.api.errors import APIError
from mlxserve.api.pipeline import Accumulator, OutputDelta, ToolCallDelta, Usage
from mlxserve.api.sealed import seal_reasoning
from mlxserve.api.sse import sse
from mlxserve.api.writer import RunEnd

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


PING: Event = ("ping", {"type": "ping"})
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(message: str, kind: str = "api_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_shape(error: APIError) -> dict[str, Any]:
    """An APIError in Anthropic's error shape (the HTTP answer of the Messages routes)."""
    default = "invalid_request_error" if error.status < 500 else "api_error"
    return error_body(error.message, ERROR_TYPES.get(error.status, default))


def error_event(message: str, kind: str = "api_error") -> Event:
    return ("error", error_body(message, kind))


class MessageEvents(BlockSequencer[Event]):
    """Anthropic stream events for one response, fed the pipeline's deltas in order."""

    def __init__(self, meta: MessageMeta) -> None:
        super().__init__()
        self.meta = meta
        self._index = -1

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
        return [("message_start", {"type": "message_start", "message": message}), PING]

    def delta(self, delta: OutputDelta) -> list[Event]:
        return self.feed(delta)

    def finish(self, end: RunEnd) -> list[Event]:
        events = self.end()
        if self._index < 0:
            # Every message has at least one block, even an empty answer.
            events += self._start_block({"type": "text", "text": ""}) + self._stop_block()
        delta = {
            "stop_reason": stop_reason(end.finish_reason, end.stop_string),
            "stop_sequence": end.stop_string,
        }
        usage = usage_body(end.usage)
        events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def fail(self, message: str, usage: Usage) -> list[Event]:
        return [error_event(message)]

    def keepalive(self) -> bytes:
        return self.frame(PING)

    def frame(self, event: Event) -> bytes:
        name, data = event
        return sse(data, event=name)

    def body(self, acc: Accumulator, end: RunEnd) -> dict[str, Any]:
        """The non-streaming message: this machine replayed over the whole output."""
        replay = MessageEvents(self.meta)
        events = replay.start(end.usage)
        for piece in acc.in_order():
            events += replay.delta(piece)
        return fold_message(events + replay.finish(end))

    def open_block(self, kind: str, call: ToolCallDelta | None) -> list[Event]:
        if kind == REASONING:
            return self._start_block({"type": "thinking", "thinking": "", "signature": ""})
        if kind == CALL:
            assert call is not None
            return self._start_block(_tool_use_block(call.id, call.name))
        return self._start_block({"type": "text", "text": ""})

    def append(self, kind: str, text: str) -> list[Event]:
        if kind == REASONING:
            if not self.meta.show_thinking:
                return []
            return [self._delta_event({"type": "thinking_delta", "thinking": text})]
        if kind == CALL:
            return [self._delta_event({"type": "input_json_delta", "partial_json": text})]
        return [self._delta_event({"type": "text_delta", "text": text})]

    def close_block(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if kind == REASONING:
            signature = seal_reasoning(text)
            events.append(self._delta_event({"type": "signature_delta", "signature": signature}))
        return events + self._stop_block()

    def _start_block(self, block: dict[str, Any]) -> list[Event]:
        self._index += 1
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return [("content_block_start", start)]

    def _stop_block(self) -> list[Event]:
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _delta_event(self, delta: dict[str, Any]) -> Event:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": delta},
        )


def _tool_use_block(call_id: str | None, name: str | None) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call_id or ""), "name": name or "", "input": {}}


# What each delta type appends to, in its block.
_DELTA_FIELDS = {
    "text_delta": "text",
    "thinking_delta": "thinking",
    "input_json_delta": "partial_json",
}


def fold_message(events: list[Event]) -> dict[str, Any]:
    """A message's events folded into the message, as a client folds the stream."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for name, data in events:
        if name == "message_start":
            message = dict(data["message"], content=[])
        elif name == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
                continue
            key = _DELTA_FIELDS[delta["type"]]
            if key == "partial_json":
                partial[data["index"]] = partial.get(data["index"], "") + delta[key]
            else:
                block[key] += delta[key]
        elif name == "content_block_stop":
            block = message["content"][data["index"]]
            if block["type"] == "tool_use":
                block["input"] = json.loads(partial.get(data["index"]) or "{}")
        elif name == "message_delta":
            message.update(data["delta"], usage=data["usage"])
    return message
