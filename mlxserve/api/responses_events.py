"""The output pipeline's deltas -> OpenAI Responses events and response (pure).

`ResponseEvents` is one response's state machine over output items: it
opens an item when the kind of output changes (reasoning, message,
function call), sends each delta as that item's delta event, and closes
items in order with their `.done` events; `finish` and `fail` end the
response. Every event carries a `sequence_number` counting up from 0. The
non-streaming body is the same machine fed the whole output as one delta
(`response_body`), so both paths give the same items.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxserve.api.pipeline import Accumulator, OutputDelta, ToolCallDelta, Usage
from mlxserve.api.sealed import seal_reasoning

Event = dict[str, Any]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseShell:
    """What every snapshot of one response repeats."""

    id: str
    model: str
    created_at: int
    # The request's settings as the response echoes them (tools, tool_choice, ...).
    settings: Mapping[str, Any] = field(default_factory=dict)
    include_encrypted: bool = False
    # Prompt tool name -> (namespace, name) for namespaced functions.
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)


def usage_body(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": min(usage.cached_tokens, usage.prompt_tokens),
            "cache_write_tokens": 0,  # the SDK's type requires it; nothing is billed here
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)
        },
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_object(
    shell: ResponseShell,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """The `response` object in a given state."""
    body: dict[str, Any] = {
        "id": shell.id,
        "object": "response",
        "created_at": shell.created_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "model": shell.model,
        "output": output,
        "usage": usage,
    }
    body.update(shell.settings)
    return body


@dataclass
class _Open:
    """The output item being streamed."""

    kind: str  # "reasoning", "message" or "function_call"
    item: dict[str, Any]
    index: int  # its output_index
    text: list[str] = field(default_factory=list)
    call_index: int = -1  # the pipeline's tool-call index


class ResponseEvents:
    """Responses stream events for one response, fed the pipeline's deltas in order.

    Tool-call deltas arrive per call in order (a call's first delta has its id
    and name, argument fragments follow); fragments concatenate to the final
    `arguments`, whether they come in one piece or many.
    """

    def __init__(self, shell: ResponseShell, new_id: Callable[[str], str] = new_item_id) -> None:
        self.shell = shell
        self.output: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self._new_id = new_id
        self._seq = 0
        self._open: _Open | None = None
        self._pending_space = ""  # whitespace-only text not yet worth a message
        self._had_call = False
        self._reasoning: list[str] = []

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning)

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[Event]:
        snapshot = response_object(self.shell, "in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=dict(snapshot)),
        ]

    def delta(self, delta: OutputDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._reasoning_delta(delta.reasoning)
        if delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def finish(
        self, finish_reason: str | None, usage: Usage, reasoning_tokens: int = 0
    ) -> list[Event]:
        """Close the open item and end the response (`incomplete` at the token limit)."""
        events: list[Event] = []
        if self._pending_space and not self._had_call:
            events += self._text("", force=True)
        truncated = finish_reason == "length"
        events += self._close("incomplete" if truncated else "completed")
        status = "incomplete" if truncated else "completed"
        self.final = response_object(
            self.shell,
            status,
            list(self.output),
            usage_body(usage, reasoning_tokens),
            incomplete="max_output_tokens" if truncated else None,
        )
        events.append(self._event(f"response.{status}", response=self.final))
        return events

    def fail(self, message: str, usage: Usage) -> list[Event]:
        """An `error` event, then `response.failed` (items finished so far kept)."""
        error = {"code": "server_error", "message": message}
        self.final = response_object(
            self.shell, "failed", list(self.output), usage_body(usage), error=error
        )
        return [
            self._event("error", code="server_error", message=message, param=None),
            self._event("response.failed", response=self.final),
        ]

    def _item_event(self, opened: _Open, kind: str, **fields: Any) -> Event:
        return self._event(kind, item_id=opened.item["id"], output_index=opened.index, **fields)

    def _begin(self, kind: str, item: dict[str, Any]) -> list[Event]:
        events = self._close("completed")
        self._open = _Open(kind, item, len(self.output))
        added = self._event(
            "response.output_item.added", output_index=self._open.index, item=dict(item)
        )
        return [*events, added]

    def _reasoning_delta(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != "reasoning":
            item = {
                "id": self._new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            events += self._begin("reasoning", item)
        opened = self._open
        assert opened is not None
        opened.text.append(text)
        self._reasoning.append(text)
        events.append(
            self._item_event(opened, "response.reasoning_text.delta", content_index=0, delta=text)
        )
        return events

    def _text(self, text: str, force: bool = False) -> list[Event]:
        is_open = self._open is not None and self._open.kind == "message"
        if not is_open and not text.strip() and not force:
            self._pending_space += text
            return []
        events: list[Event] = []
        if not is_open:
            item = {
                "id": self._new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            events += self._begin("message", item)
            assert self._open is not None
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(
                self._item_event(
                    self._open, "response.content_part.added", content_index=0, part=part
                )
            )
        opened = self._open
        assert opened is not None
        text, self._pending_space = self._pending_space + text, ""
        opened.text.append(text)
        events.append(
            self._item_event(
                opened, "response.output_text.delta", content_index=0, delta=text, logprobs=[]
            )
        )
        return events

    def _call(self, call: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if call.id is not None or call.name is not None:
            self._had_call = True
            namespace, name = self.shell.namespaces.get(call.name or "", (None, call.name or ""))
            item: dict[str, Any] = {
                "id": self._new_id("fc"),
                "type": "function_call",
                "call_id": call.id or self._new_id("call"),
                "name": name,
                "arguments": "",
                "status": "in_progress",
            }
            if namespace is not None:
                item["namespace"] = namespace
            events += self._begin("function_call", item)
            assert self._open is not None
            self._open.call_index = call.index
        opened = self._open
        if call.arguments and opened is not None and opened.kind == "function_call":
            opened.text.append(call.arguments)
            events.append(
                self._item_event(
                    opened, "response.function_call_arguments.delta", delta=call.arguments
                )
            )
        return events

    def _close(self, status: str) -> list[Event]:
        """The `.done` events of the open item; it joins `output`."""
        opened, self._open = self._open, None
        if opened is None:
            return []
        text = "".join(opened.text)
        item = dict(opened.item, status=status)
        if opened.kind == "reasoning":
            events = [
                self._item_event(opened, "response.reasoning_text.done", content_index=0, text=text)
            ]
            item["content"] = [{"type": "reasoning_text", "text": text}]
            if self.shell.include_encrypted:
                item["encrypted_content"] = seal_reasoning(text)
        elif opened.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            events = [
                self._item_event(
                    opened, "response.output_text.done", content_index=0, text=text, logprobs=[]
                ),
                self._item_event(opened, "response.content_part.done", content_index=0, part=part),
            ]
            item["content"] = [part]
        else:
            events = []
            if not text:  # a call without arguments still streams the "{}" it ends with
                text = "{}"
                events.append(
                    self._item_event(opened, "response.function_call_arguments.delta", delta=text)
                )
            done = self._item_event(
                opened, "response.function_call_arguments.done", arguments=text, name=item["name"]
            )
            events.append(done)
            item["arguments"] = text
        self.output.append(item)
        events.append(
            self._event("response.output_item.done", output_index=opened.index, item=item)
        )
        return events


def response_body(
    shell: ResponseShell,
    acc: Accumulator,
    usage: Usage,
    count_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """The non-streaming response: the event machine fed the whole output, in the
    order it was made, so its items are the ones a stream ends with."""
    writer = ResponseEvents(shell)
    for run in acc.in_order():
        writer.delta(run)
    reasoning = writer.reasoning_text
    tokens = count_tokens(reasoning) if count_tokens is not None and reasoning else 0
    writer.finish(acc.finish_reason, usage, tokens)
    assert writer.final is not None
    return writer.final
