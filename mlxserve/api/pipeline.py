"""One request's output pipeline: token events -> OpenAI-shaped deltas.

    TokenEvent ─► incremental detokenizer (UTF-8 safe, EOS dropped)
               ─► stop-string matcher (withholds a possible stop prefix)
               ─► parser chain (reasoning, tool calls) ─► OutputDelta

Streaming sends each OutputDelta as a chunk; non-streaming folds the same
deltas into one message (`Accumulator`), so both paths agree byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxserve.api.detok import IncrementalDecoder
from mlxserve.api.stops import StopMatcher
from mlxserve.api.token_bytes import token_bytes_for
from mlxserve.engine.request import TokenEvent
from mlxserve.parsers.events import (
    ContentDelta,
    ParserEvent,
    ReasoningDelta,
    StreamParser,
    ToolCallArgs,
    ToolCallDiscard,
    ToolCallEnd,
    ToolCallStart,
)

ParserFactory = Callable[[bool, bool], StreamParser]


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call: the first one of a call has `id` and `name`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


# A token the grammar masks out has log-probability -inf, which JSON cannot carry; vLLM
# sends -9999.0 for it, and so does this server.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()
    # The token's own bytes, and those of each `top` entry in order: a token can hold
    # part of a character, which its text shows as U+FFFD. Left out (None, or no
    # `top_bytes`), a token's bytes are its text's UTF-8.
    token_bytes: bytes | None = None
    top_bytes: tuple[bytes, ...] = ()

    def utf8(self) -> bytes:
        """The token's own bytes (the `bytes` of a log-probability)."""
        return self.token.encode("utf-8") if self.token_bytes is None else self.token_bytes

    def top_utf8(self) -> list[bytes]:
        """The own bytes of each `top` entry, in order."""
        if len(self.top_bytes) == len(self.top):
            return list(self.top_bytes)
        return [text.encode("utf-8") for text, _ in self.top]


@dataclass
class OutputDelta:
    """What one engine event adds to the response."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    # Calls streamed earlier that turned out malformed: a whole message leaves them
    # out (a stream cannot take back what it sent; their text follows as content).
    discarded: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (
            self.reasoning
            or self.content
            or self.tool_calls
            or self.logprobs
            or self.finish_reason
            or self.discarded
        )


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class EngineRequestFailed(RuntimeError):
    """The engine finished the request with an error (or aborted it on its own)."""


class OutputPipeline:
    """Turns one request's TokenEvents into OutputDeltas. `done` once finished."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        prompt_tokens: int,
        stops: Sequence[str] = (),
        parser: StreamParser | None = None,
        logprobs: bool = False,
        parallel_tool_calls: bool = True,
        prompt_tail: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._detok = IncrementalDecoder(tokenizer, prompt_tail)
        self._eos = eos_token_ids
        self._stops = StopMatcher(stops)
        self._parser = parser
        self._logprobs = logprobs
        self._token_bytes = token_bytes_for(tokenizer) if logprobs else None
        self._parallel = parallel_tool_calls
        self._only_call: int | None = None  # with parallel_tool_calls off
        self._args_sent: set[int] = set()
        self._calls_done: set[int] = set()
        self.usage = Usage(prompt_tokens=prompt_tokens)
        self.done = False
        self.finish_reason: str | None = None

    @property
    def stopped_by_string(self) -> bool:
        return self._stops.matched is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stops.matched

    def step(self, event: TokenEvent) -> OutputDelta:
        """Process one engine event. Raises EngineRequestFailed for error/abort."""
        if self.done:
            return OutputDelta()
        self._account(event)
        if event.finish_reason in ("error", "abort"):
            self.done = True
            raise EngineRequestFailed(
                event.error or f"request {event.finish_reason}ed by the engine"
            )
        delta = OutputDelta()
        text = ""
        token = event.token_id
        if token is not None and token not in self._eos:
            text = self._detok.add(token)
            if self._logprobs and event.logprob is not None:
                delta.logprobs.append(self._token_logprob(token, event))
        if event.finished:
            text += self._detok.flush()
        text = self._stops.feed(text)
        ending = event.finished or self.stopped_by_string
        if ending:
            text += self._stops.flush()
        events = self._parse(text, ending)
        self._apply(events, delta)
        if ending:
            self.done = True
            delta.finish_reason = self._finish_reason(event.finish_reason)
            self.finish_reason = delta.finish_reason
        return delta

    def _account(self, event: TokenEvent) -> None:
        u = self.usage
        if event.token_id is not None:
            u.completion_tokens += 1
        u.completion_tokens = max(u.completion_tokens, event.completion_tokens)
        u.prompt_tokens = max(u.prompt_tokens, event.prompt_tokens)
        u.cached_tokens = max(u.cached_tokens, event.cached_tokens)

    def _parse(self, text: str, ending: bool) -> list[ParserEvent]:
        if self._parser is None:
            return [ContentDelta(text)] if text else []
        events = self._parser.feed(text) if text else []
        if ending:
            events += self._parser.finish()
        return events

    def _apply(self, events: list[ParserEvent], delta: OutputDelta) -> None:
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                delta.reasoning += ev.text
            elif isinstance(ev, ContentDelta):
                delta.content += ev.text
            elif not self._admits(ev):
                continue
            elif isinstance(ev, ToolCallDiscard):
                delta.discarded.append(ev.index)
            elif isinstance(ev, ToolCallStart):
                delta.tool_calls.append(ToolCallDelta(ev.index, ev.id, ev.name, ""))
            elif isinstance(ev, ToolCallArgs):
                if ev.arguments:
                    self._args_sent.add(ev.index)
                    delta.tool_calls.append(ToolCallDelta(ev.index, arguments=ev.arguments))
            elif isinstance(ev, ToolCallEnd):
                self._calls_done.add(ev.index)
                if ev.index not in self._args_sent:
                    self._args_sent.add(ev.index)
                    args = ev.arguments_json or json.dumps(ev.arguments, ensure_ascii=False)
                    delta.tool_calls.append(ToolCallDelta(ev.index, arguments=args))

    def _admits(self, event: ToolCallStart | ToolCallArgs | ToolCallEnd | ToolCallDiscard) -> bool:
        """Every call, or with parallel tool calls off only the first that is not discarded."""
        if self._parallel:
            return True
        if self._only_call is None and isinstance(event, ToolCallStart):
            self._only_call = event.index
        admitted = event.index == self._only_call
        if admitted and isinstance(event, ToolCallDiscard):
            self._only_call = None
        return admitted

    def _finish_reason(self, engine_reason: str | None) -> str:
        if self.stopped_by_string:
            return "stop"
        if engine_reason == "length":
            return "length"
        return "tool_calls" if self._calls_done else "stop"

    def _token_logprob(self, token: int, event: TokenEvent) -> TokenLogprob:
        assert event.logprob is not None and self._token_bytes is not None
        alternatives = event.top_logprobs or ()
        top = tuple((self._token_text(t), _floored(lp)) for t, lp in alternatives)
        top_bytes = tuple(self._token_bytes(int(t)) for t, _ in alternatives)
        own = self._token_bytes(token)
        return TokenLogprob(self._token_text(token), _floored(event.logprob), top, own, top_bytes)

    def _token_text(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))


def _floored(logprob: float) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


class TextLogprobs:
    """Which tokens' log-probabilities belong to the text of each delta, in order.

    A token's text can come out after its log-probability (held back by the
    detokenizer, a possible stop string or a parser still deciding what it
    reads): those wait for the next text. Tokens that come out as reasoning or
    as a tool call belong to that, not to the text.
    """

    def __init__(self) -> None:
        self._waiting: list[TokenLogprob] = []

    def take(self, delta: OutputDelta) -> list[TokenLogprob]:
        """The log-probabilities of `delta.content` (empty when it has none)."""
        self._waiting += delta.logprobs
        if delta.content:
            taken, self._waiting = self._waiting, []
            return taken
        if delta.reasoning or delta.tool_calls:
            self._waiting = []
        return []


@dataclass
class _CallAcc:
    id: str = ""
    name: str = ""
    arguments: str = ""


class Accumulator:
    """Folds OutputDeltas into a whole message (the non-streaming response)."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: dict[int, _CallAcc] = {}
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        # The order output came in: ("reasoning" | "text", piece) or ("call", index).
        self._order: list[tuple[str, str | int]] = []
        # The log-probabilities of each text piece, by its place in `_order`.
        self._text_logprobs = TextLogprobs()
        self._piece_logprobs: dict[int, list[TokenLogprob]] = {}

    def add(self, delta: OutputDelta) -> None:
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
            self._order.append(("reasoning", delta.reasoning))
        text_logprobs = self._text_logprobs.take(delta)
        if delta.content:
            self.content.append(delta.content)
            if text_logprobs:
                self._piece_logprobs[len(self._order)] = text_logprobs
            self._order.append(("text", delta.content))
        for tc in delta.tool_calls:
            if tc.index not in self.calls:
                self._order.append(("call", tc.index))
            acc = self.calls.setdefault(tc.index, _CallAcc())
            acc.id = tc.id or acc.id
            acc.name = tc.name or acc.name
            acc.arguments += tc.arguments
        for index in delta.discarded:
            self.calls.pop(index, None)
        self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.content)

    def in_order(self) -> list[OutputDelta]:
        """The output as it was made, one delta per stretch of reasoning or text and
        one per whole tool call, as a stream shows it. Calls later discarded are left
        out, and the text on either side of one joins. A text run carries its tokens'
        log-probabilities (see `TextLogprobs`)."""
        runs: list[OutputDelta] = []
        for place, (kind, value) in enumerate(self._order):
            if kind == "call":
                call = self.calls.get(int(value))
                if call is not None:
                    tool_call = ToolCallDelta(int(value), call.id, call.name, call.arguments)
                    runs.append(OutputDelta(tool_calls=[tool_call]))
                continue
            piece = str(value)
            last = runs[-1] if runs else None
            if kind == "reasoning" and last is not None and last.reasoning:
                last.reasoning += piece
            elif kind == "text" and last is not None and last.content:
                last.content += piece
                last.logprobs += self._piece_logprobs.get(place, [])
            elif kind == "reasoning":
                runs.append(OutputDelta(reasoning=piece))
            else:
                logprobs = list(self._piece_logprobs.get(place, ()))
                runs.append(OutputDelta(content=piece, logprobs=logprobs))
        return runs

    def message(self) -> dict[str, Any]:
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments or "{}"},
            }
            for _, c in sorted(self.calls.items())
        ]
        content = "".join(self.content)
        return {
            "role": "assistant",
            "content": content if content or not calls else None,
            "reasoning_content": "".join(self.reasoning) or None,
            "tool_calls": calls,
        }
