"""The pipeline's deltas -> OpenAI chunks and response objects (pure).

Pure functions from the pipeline's typed deltas to JSON-ready dicts, and
`ChunkWriter`, the OpenAI dialect's writer for chat and text completions.
No engine or HTTP code here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxserve.api.errors import error_body
from mlxserve.api.pipeline import Accumulator, OutputDelta, TokenLogprob, ToolCallDelta, Usage
from mlxserve.api.sse import SSE_COMMENT, sse
from mlxserve.api.writer import RunEnd

DONE = "[DONE]"
Event = dict[str, Any] | str  # a chunk, or the literal that ends the stream


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response repeats."""

    id: str
    model: str
    created: int
    kind: str = "chat"  # "chat" or "text"
    include_usage: bool = False


def _tool_call_wire(tc: ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": tc.index}
    function: dict[str, Any] = {}
    if tc.id is not None:
        out["id"] = tc.id
        out["type"] = "function"
    if tc.name is not None:
        function["name"] = tc.name
    function["arguments"] = tc.arguments
    out["function"] = function
    return out


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.utf8()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(raw)}
                    for (t, v), raw in zip(lp.top, lp.top_utf8(), strict=True)
                ],
            }
            for lp in items
        ]
    }


def text_logprobs(items: list[TokenLogprob], start_offset: int = 0) -> dict[str, Any]:
    offsets: list[int] = []
    pos = start_offset
    for lp in items:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [dict(lp.top) for lp in items],
        "text_offset": offsets,
    }


def _chunk(meta: ResponseMeta, choices: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if meta.kind == "chat" else "text_completion"
    out: dict[str, Any] = {
        "id": meta.id,
        "object": obj,
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
    }
    if meta.include_usage:
        out["usage"] = None
    return out


def chat_role_chunk(meta: ResponseMeta) -> dict[str, Any]:
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return _chunk(meta, [choice])


def chat_delta_chunk(meta: ResponseMeta, delta: OutputDelta) -> dict[str, Any] | None:
    """The chunk for one delta's text and tool calls (None when it carries none)."""
    wire: dict[str, Any] = {}
    if delta.reasoning:
        wire["reasoning_content"] = delta.reasoning
    if delta.content:
        wire["content"] = delta.content
    if delta.tool_calls:
        wire["tool_calls"] = [_tool_call_wire(tc) for tc in delta.tool_calls]
    if not wire and not delta.logprobs:
        return None
    choice = {
        "index": 0,
        "delta": wire,
        "logprobs": chat_logprobs(delta.logprobs) if delta.logprobs else None,
        "finish_reason": None,
    }
    return _chunk(meta, [choice])


def text_delta_chunk(meta: ResponseMeta, delta: OutputDelta, offset: int) -> dict[str, Any] | None:
    if not delta.content and not delta.logprobs:
        return None
    choice = {
        "index": 0,
        "text": delta.content,
        "logprobs": text_logprobs(delta.logprobs, offset) if delta.logprobs else None,
        "finish_reason": None,
    }
    return _chunk(meta, [choice])


def finish_chunk(meta: ResponseMeta, finish_reason: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if meta.kind == "chat":
        choice["delta"] = {}
    else:
        choice["text"] = ""
    return _chunk(meta, [choice])


def usage_chunk(meta: ResponseMeta, usage: Usage) -> dict[str, Any]:
    out = _chunk(meta, [])
    out["usage"] = usage.to_dict()
    return out


def chat_response(meta: ResponseMeta, acc: Accumulator, usage: Usage) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": acc.message(),
        "logprobs": chat_logprobs(acc.logprobs) if acc.logprobs else None,
        "finish_reason": acc.finish_reason or "stop",
    }
    return _whole(meta, "chat.completion", choice, usage)


def text_response(meta: ResponseMeta, acc: Accumulator, usage: Usage) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": acc.text,
        "logprobs": text_logprobs(acc.logprobs) if acc.logprobs else None,
        "finish_reason": acc.finish_reason or "stop",
    }
    return _whole(meta, "text_completion", choice, usage)


def _whole(meta: ResponseMeta, kind: str, choice: dict[str, Any], usage: Usage) -> dict[str, Any]:
    """A non-streamed response object around its one choice."""
    return {
        "id": meta.id,
        "object": kind,
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage.to_dict(),
    }


class ChunkWriter:
    """OpenAI chat or text completion chunks for one response."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self._offset = 0  # text completions: where the next logprobs' text starts

    def start(self, usage: Usage) -> list[Event]:
        return [chat_role_chunk(self.meta)] if self.meta.kind == "chat" else []

    def delta(self, delta: OutputDelta) -> list[Event]:
        if self.meta.kind == "chat":
            chunk = chat_delta_chunk(self.meta, delta)
        else:
            chunk = text_delta_chunk(self.meta, delta, self._offset)
            self._offset += len(delta.content)
        return [chunk] if chunk is not None else []

    def finish(self, end: RunEnd) -> list[Event]:
        return [finish_chunk(self.meta, end.finish_reason), *self._tail(end.usage)]

    def fail(self, message: str, usage: Usage) -> list[Event]:
        error = error_body(message, "server_error", code="generation_failed")
        return [error, *self._tail(usage)]

    def _tail(self, usage: Usage) -> list[Event]:
        usage_chunks: list[Event] = (
            [usage_chunk(self.meta, usage)] if self.meta.include_usage else []
        )
        return [*usage_chunks, DONE]

    def keepalive(self) -> bytes:
        return SSE_COMMENT

    def frame(self, event: Event) -> bytes:
        return sse(event)

    def body(self, acc: Accumulator, end: RunEnd) -> dict[str, Any]:
        build = chat_response if self.meta.kind == "chat" else text_response
        return build(self.meta, acc, end.usage)
