"""DeepSeek-V4 and V4.1 prompt encoders (byte-exact with the reference format).

The prompt is a flat string that starts with BOS:

    <｜begin▁of▁sentence｜>[effort preamble][system text]
    <｜User｜>user turn<｜Assistant｜><think>reasoning</think>reply[DSML calls]<｜end▁of▁sentence｜>
    <｜User｜>...<｜Assistant｜><think>            (thinking mode; chat mode ends with </think>)

Rules (see tests/data/README.md; every one is pinned by a golden):

* A system message is bare text (V4) or `<｜System｜>text` (V4.1). A developer
  message is its own `<｜User｜>` turn. Consecutive user and tool messages are
  merged into one user turn, parts joined by a blank line; tool results become
  `<tool_result>…</tool_result>` in the order of the preceding assistant's
  tool-call ids.
* A user turn followed by an assistant reply (or ending the prompt) closes with
  `<｜Assistant｜>` and `<think>` when the reply's reasoning is shown (or, at
  the end, in thinking mode), else `</think>`.
* Thinking mode with drop-thinking (the default, forced off by tools): the
  reasoning of replies before the last user/tool/developer message is not
  shown, and developer messages before it are dropped. Chat mode shows none.
* Tools: one `## Tools` section appended to a system message (V4: a leading
  system/developer message; V4.1: the first system message anywhere), else to
  a new empty system message inserted first.
* Reasoning effort, thinking mode only: V4 writes a fixed preamble (high or
  max; low writes none) before the first message; V4.1 writes
  `<｜System｜>Reasoning Effort: N (...)` followed by a blank line, which a
  leading system message continues without its own marker. "none" selects
  chat mode in both.
* V4.1 only: a prompt that ends with an assistant reply gets a fresh
  `<｜Assistant｜><think>` (or `</think>`) after it; V4 ends at the reply's EOS.
* V4.1 only: a system message after the first counts as a user turn: the
  history drop-thinking hides ends at it, and it opens the reply that follows
  it (or ends the prompt) like a user turn does.
* V4.1 only: tool-call arguments that are no JSON object are decoded once more
  (a double-encoded object is that object), else rendered as one `arguments`
  parameter (V4 requires an object). JSON null is such a value (V4.1's
  wrapper does not turn it into `{}` as V4's does): `string="false">null`.
* An empty developer message is an error only where it is rendered:
  drop-thinking drops those before the last user turn unseen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from mlxserve.chat.dsml import (
    V4_DSML,
    V41_DSML,
    Dsml,
    render_tool_calls,
    render_tools,
    to_json,
    tool_schemas,
)
from mlxserve.chat.messages import (
    AssistantMessage,
    DeveloperMessage,
    Message,
    PromptError,
    SystemMessage,
    ToolMessage,
    UserMessage,
    normalise_messages,
)

Variant = Literal["v4", "v41"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM_V41 = "<｜System｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_V4_EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem "
    "to resolve the root cause, rigorously stress-testing your logic against all potential "
    "paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no "
    "assumption is left unchecked."
)
_V4_EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every "
    "causal chain to its root, and resolve the underlying cause rather than any surface "
    "symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from "
    "multiple angles and are certain that no assumption remains unchecked and no error "
    "remains undiscovered."
)
_V4_LOW_EFFORTS = frozenset({"low", "minimal", "medium"})
_V41_EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
_V41_EFFORT_LINE = (
    "Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)"
)
_RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)


@dataclass(frozen=True)
class _Format:
    """What differs between V4 and V4.1."""

    dsml: Dsml
    join: str  # separator of a content list's text blocks
    strict_arguments: bool  # V4 rejects non-JSON arguments; V4.1 renders them as a string
    system_marker: str
    tools_in_any_system: bool
    prompt_after_reply: bool  # V4.1 opens a new reply after a final assistant message
    # V4.1: a system message after the first counts as a user turn (it ends the
    # history drop-thinking hides and opens the reply that follows it).
    mid_system_is_user: bool


_FORMATS: dict[str, _Format] = {
    "v4": _Format(V4_DSML, "\n", True, "", False, False, False),
    "v41": _Format(V41_DSML, "\n\n", False, SYSTEM_V41, True, True, True),
}


@dataclass(frozen=True)
class _Turn:
    """One rendered unit: system text, a user turn, or an assistant reply."""

    kind: Literal["system", "user", "assistant"]
    text: str = ""
    reply: AssistantMessage | None = None
    show_reasoning: bool = False


def encode_request(request: Mapping[str, Any], variant: Variant = "v4") -> str:
    """Render a chat request into the DeepSeek-V4 (or V4.1) prompt string.

    `request` holds `messages` (OpenAI dicts), `tools` (list, [] or None),
    `thinking` (default True), `reasoning_effort` (None, a string, or for
    V4.1 an int 1-100) and optionally `drop_thinking` (default True).
    Raises PromptError for a request the format cannot express.
    """
    fmt = _FORMATS.get(variant)
    if fmt is None:
        raise PromptError(f"unknown DeepSeek prompt variant {variant!r}; expected v4 or v41")
    raw_messages = request.get("messages")
    if not raw_messages:
        raise PromptError("'messages' must be a non-empty list")
    thinking, preamble = _resolve_effort(
        variant, _flag(request, "thinking"), request.get("reasoning_effort")
    )
    messages = normalise_messages(
        raw_messages, join=fmt.join, strict_arguments=fmt.strict_arguments
    )
    schemas = tool_schemas(request.get("tools") or [])
    drop = thinking and _flag(request, "drop_thinking") and not schemas
    _validate(messages, drop, fmt.mid_system_is_user)
    turns = _build_turns(
        _attach_tools(fmt, messages, schemas), thinking, drop, fmt.mid_system_is_user
    )
    return _render(fmt, turns, thinking, preamble)


def _flag(request: Mapping[str, Any], key: str) -> bool:
    value = request.get(key)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise PromptError(f"'{key}' must be a boolean")
    return value


def _resolve_effort(variant: Variant, thinking: bool, effort: Any) -> tuple[bool, str]:
    """(thinking mode, preamble text) for a reasoning effort."""
    if effort == "none":
        return False, ""
    if variant == "v41":
        level = _v41_effort(effort)
        return thinking, _V41_EFFORT_LINE.format(n=level) if thinking else ""
    if effort is not None and not isinstance(effort, str):
        raise PromptError("'reasoning_effort' must be a string for DeepSeek-V4")
    if not thinking or effort in _V4_LOW_EFFORTS:
        return thinking, ""
    return True, _V4_EFFORT_MAX if effort == "max" else _V4_EFFORT_HIGH


def _v41_effort(effort: Any) -> int:
    if effort is None:
        return _V41_EFFORTS["high"]
    if isinstance(effort, str) and effort in _V41_EFFORTS:
        return _V41_EFFORTS[effort]
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        return effort
    raise PromptError(
        f"'reasoning_effort' {effort!r} is not supported by DeepSeek-V4.1; use one of "
        "none, low, high, xhigh, max or an integer from 1 to 100"
    )


def _last_user(messages: Sequence[Message], mid_system: bool = False) -> int:
    """Index of the last user, tool or developer message (-1 if none).

    With `mid_system` (V4.1) a system message after the first counts too.
    """
    return max(
        (
            i
            for i, m in enumerate(messages)
            if isinstance(m, (UserMessage, ToolMessage, DeveloperMessage))
            or (mid_system and i > 0 and isinstance(m, SystemMessage))
        ),
        default=-1,
    )


def _validate(messages: Sequence[Message], drop: bool, mid_system: bool) -> None:
    """Reject an empty developer message that would be rendered.

    Like the reference, the check applies to the developer messages that are
    kept: with drop-thinking those before the last user turn are dropped
    unseen, so an empty one there is fine.
    """
    last_user = _last_user(messages, mid_system)
    for i, msg in enumerate(messages):
        if isinstance(msg, DeveloperMessage) and not msg.content and not (drop and i < last_user):
            raise PromptError(f"messages[{i}]: a developer message must have non-empty content")


def _system_text(msg: SystemMessage | DeveloperMessage, tools: str | None) -> str:
    text = msg.content
    if tools is not None:
        text += "\n\n" + tools
    if msg.response_format is not None:
        text += "\n\n" + _RESPONSE_FORMAT.format(schema=to_json(msg.response_format))
    return text


def _attach_tools(
    fmt: _Format, messages: list[Message], schemas: Sequence[Mapping[str, Any]]
) -> list[Message]:
    """Messages with system/developer text final: tools and response formats rendered in."""
    host = -1
    if schemas:
        if fmt.tools_in_any_system:
            host = next((i for i, m in enumerate(messages) if isinstance(m, SystemMessage)), -1)
        elif isinstance(messages[0], (SystemMessage, DeveloperMessage)):
            host = 0
        if host < 0:
            messages = [SystemMessage(""), *messages]
            host = 0
    tools = render_tools(fmt.dsml, schemas) if schemas else None
    out: list[Message] = []
    for i, msg in enumerate(messages):
        if isinstance(msg, (SystemMessage, DeveloperMessage)):
            text = _system_text(msg, tools if i == host else None)
            msg = replace(msg, content=text, response_format=None)
        out.append(msg)
    return out


def _build_turns(
    messages: Sequence[Message], thinking: bool, drop: bool, mid_system: bool
) -> list[_Turn]:
    """Group messages into turns, applying drop-thinking and tool-result merging."""
    last_user = _last_user(messages, mid_system)
    turns: list[_Turn] = []
    pending: list[UserMessage | ToolMessage] = []
    call_ids: list[str | None] = []
    for i, msg in enumerate(messages):
        if isinstance(msg, (UserMessage, ToolMessage)):
            pending.append(msg)
            continue
        if pending:
            turns.append(_Turn("user", _merge_user(pending, call_ids)))
            pending = []
        if isinstance(msg, AssistantMessage):
            show = thinking and (not drop or i > last_user)
            turns.append(_Turn("assistant", reply=msg, show_reasoning=show))
            call_ids = [c.id for c in msg.tool_calls]
        elif isinstance(msg, DeveloperMessage):
            if not (drop and i < last_user):
                turns.append(_Turn("user", msg.content))
        else:
            turns.append(_Turn("system", msg.content))
    if pending:
        turns.append(_Turn("user", _merge_user(pending, call_ids)))
    return turns


def _merge_user(parts: Sequence[UserMessage | ToolMessage], call_ids: Sequence[str | None]) -> str:
    """One user turn from consecutive user/tool messages; tool results in call order."""
    order = {cid: n for n, cid in enumerate(call_ids) if cid is not None}

    def rank(result: ToolMessage) -> int:
        if result.tool_call_id is None:
            return len(order)
        return order.get(result.tool_call_id, len(order))

    texts: list[str] = []
    results: list[ToolMessage] = []
    for part in [*parts, None]:
        if isinstance(part, ToolMessage):
            results.append(part)
            continue
        # A run of tool results ends: emit it sorted (stable for unknown ids).
        texts.extend(f"<tool_result>{r.content}</tool_result>" for r in sorted(results, key=rank))
        results = []
        if part is not None:
            texts.append(part.content)
    return "\n\n".join(texts)


def _render(fmt: _Format, turns: Sequence[_Turn], thinking: bool, preamble: str) -> str:
    out = [BOS]
    skip_marker = False
    if preamble:
        if fmt.system_marker:
            out.append(fmt.system_marker)
            skip_marker = bool(turns) and turns[0].kind == "system"
        out.append(preamble + "\n\n")
    for n, turn in enumerate(turns):
        nxt = turns[n + 1] if n + 1 < len(turns) else None
        if turn.kind == "system":
            out.append(("" if n == 0 and skip_marker else fmt.system_marker) + turn.text)
            opens_reply = fmt.mid_system_is_user and (n > 0 or nxt is None)
            if opens_reply and nxt is None:
                out.append(ASSISTANT + (THINK_OPEN if thinking else THINK_CLOSE))
            elif opens_reply and nxt is not None and nxt.kind == "assistant":
                out.append(ASSISTANT + (THINK_OPEN if nxt.show_reasoning else THINK_CLOSE))
        elif turn.kind == "user":
            out.append(USER + turn.text)
            if nxt is None:
                out.append(ASSISTANT + (THINK_OPEN if thinking else THINK_CLOSE))
            elif nxt.kind == "assistant":
                out.append(ASSISTANT + (THINK_OPEN if nxt.show_reasoning else THINK_CLOSE))
        else:
            assert turn.reply is not None
            out.append(_render_reply(fmt, turn.reply, turn.show_reasoning))
            if nxt is None and fmt.prompt_after_reply:
                out.append(ASSISTANT + (THINK_OPEN if thinking else THINK_CLOSE))
    return "".join(out)


def _render_reply(fmt: _Format, reply: AssistantMessage, show_reasoning: bool) -> str:
    text = (reply.reasoning or "") + THINK_CLOSE if show_reasoning else ""
    text += reply.content or ""
    if reply.tool_calls:
        text += "\n\n" + render_tool_calls(fmt.dsml, reply.tool_calls)
    return text + EOS
