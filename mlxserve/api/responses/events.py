"""The output pipeline's deltas -> OpenAI Responses events and response (pure).

`ResponseEvents` is one response's writer: the shared block sequencer cuts
the output into items (reasoning, message, function call), and this file
spells them as Responses events: an item's `added` event, its delta events,
its `.done` events; `finish` and `fail` end the response. Every event
carries a `sequence_number` counting up from 0. The non-streaming body is
the same machine fed the whole output (`body`), so both paths give the
same items. `keep` is handed each finished response (the store).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxserve.api.blocks import REASONING, TEXT, BlockSequencer
from mlxserve.api.pipeline import (
    Accumulator,
    OutputDelta,
    TextLogprobs,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from mlxserve.api.sealed import seal_reasoning
from mlxserve.api.sse import SSE_COMMENT, sse
from mlxserve.api.writer import RunEnd

Event = dict[str, Any]
Keep = Callable[[Mapping[str, Any]], None]


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
    # `include: ["message.output_text.logprobs"]`: output text carries token log-probabilities.
    include_logprobs: bool = False
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


def event_logprobs(items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Log-probabilities as the text delta and done events spell them."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "top_logprobs": [{"token": t, "logprob": v} for t, v in lp.top],
        }
        for lp in items
    ]


def part_logprobs(items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Log-probabilities as an `output_text` part spells them (with UTF-8 bytes)."""

    def entry(token: str, raw: bytes, logprob: float) -> dict[str, Any]:
        return {"token": token, "bytes": list(raw), "logprob": logprob}

    return [
        {
            **entry(lp.token, lp.utf8(), lp.logprob),
            "top_logprobs": [
                entry(t, raw, v) for (t, v), raw in zip(lp.top, lp.top_utf8(), strict=True)
            ],
        }
        for lp in items
    ]


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


class ResponseEvents(BlockSequencer[Event]):
    """Responses stream events for one response, fed the pipeline's deltas in order.

    Tool-call deltas arrive per call in order (a call's first delta has its id
    and name, argument fragments follow); fragments concatenate to the final
    `arguments`, whether they come in one piece or many. `count_tokens` counts
    the reasoning tokens `usage` reports.
    """

    def __init__(
        self,
        shell: ResponseShell,
        new_id: Callable[[str], str] = new_item_id,
        count_tokens: Callable[[str], int] | None = None,
        keep: Keep | None = None,
    ) -> None:
        super().__init__()
        self.shell = shell
        self.output: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self._new_id = new_id
        self._count_tokens = count_tokens
        self._keep = keep
        self._seq = 0
        self._item: dict[str, Any] = {}  # the open item, as `added` showed it
        self._status = "completed"  # what closing the open item makes it
        # Log-probabilities of text not yet appended, and of the open text part.
        self._text_logprobs = TextLogprobs()
        self._unsent: list[TokenLogprob] = []
        self._part_logprobs: list[TokenLogprob] = []

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self, usage: Usage | None = None) -> list[Event]:
        snapshot = response_object(self.shell, "in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=dict(snapshot)),
        ]

    def delta(self, delta: OutputDelta) -> list[Event]:
        self._unsent += self._text_logprobs.take(delta)
        return self.feed(delta)

    def finish(self, end: RunEnd) -> list[Event]:
        """Close the open item and end the response (`incomplete` at the token limit)."""
        truncated = end.finish_reason == "length"
        status = "incomplete" if truncated else "completed"
        self._status = status
        events = self.end()
        reasoning = self.reasoning_text
        tokens = self._count_tokens(reasoning) if self._count_tokens and reasoning else 0
        self.final = response_object(
            self.shell,
            status,
            list(self.output),
            usage_body(end.usage, tokens),
            incomplete="max_output_tokens" if truncated else None,
        )
        events.append(self._event(f"response.{status}", response=self.final))
        if self._keep is not None:
            self._keep(self.final)
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

    def keepalive(self) -> bytes:
        return SSE_COMMENT

    def frame(self, event: Event) -> bytes:
        return sse(event, event=str(event["type"]))

    def body(self, acc: Accumulator, end: RunEnd) -> dict[str, Any]:
        """The non-streaming response: this machine replayed over the whole output, in
        the order it was made, so its items are the ones a stream ends with."""
        replay = ResponseEvents(self.shell, self._new_id, self._count_tokens, self._keep)
        for piece in acc.in_order():
            replay.delta(piece)
        replay.finish(end)
        assert replay.final is not None
        return replay.final

    def _item_event(self, kind: str, **fields: Any) -> Event:
        index = len(self.output)
        return self._event(kind, item_id=self._item["id"], output_index=index, **fields)

    def open_block(self, kind: str, call: ToolCallDelta | None) -> list[Event]:
        self._item = self._new_item(kind, call)
        added = self._event(
            "response.output_item.added", output_index=len(self.output), item=dict(self._item)
        )
        if kind != TEXT:
            self._unsent = []  # whitespace held back before a call or reasoning: never sent
            return [added]
        self._part_logprobs = []
        part = self._part("")
        return [added, self._item_event("response.content_part.added", content_index=0, part=part)]

    def _part(self, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.shell.include_logprobs:
            part["logprobs"] = part_logprobs(self._part_logprobs)
        return part

    def _new_item(self, kind: str, call: ToolCallDelta | None) -> dict[str, Any]:
        if kind == REASONING:
            return {
                "id": self._new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
        if kind == TEXT:
            return {
                "id": self._new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
        assert call is not None
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
        return item

    def append(self, kind: str, text: str) -> list[Event]:
        if kind == REASONING:
            return [self._item_event("response.reasoning_text.delta", content_index=0, delta=text)]
        if kind == TEXT:
            sent, self._unsent = self._unsent, []
            self._part_logprobs += sent
            logprobs = event_logprobs(sent) if self.shell.include_logprobs else []
            delta = self._item_event(
                "response.output_text.delta", content_index=0, delta=text, logprobs=logprobs
            )
            return [delta]
        return [self._item_event("response.function_call_arguments.delta", delta=text)]

    def close_block(self, kind: str, text: str) -> list[Event]:
        """The `.done` events of the open item; it joins `output`."""
        item = dict(self._item, status=self._status)
        if kind == REASONING:
            events = [self._item_event("response.reasoning_text.done", content_index=0, text=text)]
            item["content"] = [{"type": "reasoning_text", "text": text}]
            if self.shell.include_encrypted:
                item["encrypted_content"] = seal_reasoning(text)
        elif kind == TEXT:
            part = self._part(text)
            logprobs = event_logprobs(self._part_logprobs) if self.shell.include_logprobs else []
            events = [
                self._item_event(
                    "response.output_text.done", content_index=0, text=text, logprobs=logprobs
                ),
                self._item_event("response.content_part.done", content_index=0, part=part),
            ]
            item["content"] = [part]
        else:
            events = []
            if not text:  # a call without arguments still streams the "{}" it ends with
                text = "{}"
                events.append(
                    self._item_event("response.function_call_arguments.delta", delta=text)
                )
            done = self._item_event(
                "response.function_call_arguments.done", arguments=text, name=item["name"]
            )
            events.append(done)
            item["arguments"] = text
        done_item = self._event(
            "response.output_item.done", output_index=len(self.output), item=item
        )
        self.output.append(item)
        return [*events, done_item]
