"""Anthropic Messages request -> the internal chat request (pure functions).

Anthropic content blocks become the OpenAI-shaped messages the chat stage
renders, so both routes share one encoder and build the same prompt for the
same conversation: `tool_use` blocks are assistant tool calls, `tool_result`
blocks are tool messages (in place, so DeepSeek folds them into the user
turn), `thinking` blocks are the reply's reasoning. A `system` message inside
`messages` is rendered where it stands: as a system turn before the first
conversation turn, as a developer turn after it. `image` blocks, in a user
turn or inside a `tool_result`, stay in place as `ImageInput`s (`api/images.py`
checks them and places or refuses them).

Thinking blocks carry a `signature` that holds their text (compressed), so a
client that was sent no thinking text (`display: "omitted"`) still re-sends
the exact reasoning and the next turn's prompt extends this one's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlxserve.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from mlxserve.api.errors import bad_request
from mlxserve.api.generation import ChatGeneration, Sampling
from mlxserve.api.notices import warn_once
from mlxserve.api.sealed import unseal_reasoning
from mlxserve.api.structured import (
    OutputConstraint,
    ToolChoice,
    answer_constraint,
    check_tool_choice,
    with_response_format,
)
from mlxserve.chat import PromptRequest
from mlxserve.chat.images import ImageInput

# Claude Code's first system block: billing metadata for Anthropic's servers, not an
# instruction, and it differs between sessions; left in, it would end every
# cross-session prefix-cache hit at the prompt's first tokens.
BILLING_HEADER = "x-anthropic-billing-header:"
_MEDIA_BLOCKS = frozenset({"document", "search_result", "container_upload"})


def _text_block(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", where)
    return text


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, Mapping):
        raise bad_request(f"{where} must be a content block object", where)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise bad_request(f"{where}.type must be a string", where)
    if kind in _MEDIA_BLOCKS:
        raise bad_request(
            f"{where}: '{kind}' blocks are not supported: this model takes text only", where
        )
    return kind


def _text_parts(content: str | Sequence[Any], where: str) -> list[dict[str, str]]:
    """A content that may hold only text: as OpenAI text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        kind = _block_type(block, here)
        if kind != "text":
            raise bad_request(f"{here}: expected a 'text' block, got '{kind}'", here)
        parts.append({"type": "text", "text": _text_block(block, here)})
    return parts


def _image(block: Mapping[str, Any], where: str) -> ImageInput:
    """An `image` block: a `base64` source, or a `url` one (read only as a data: URL)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if not isinstance(source, Mapping) or not isinstance(kind, str):
        raise bad_request(f"{where}.source must be an object with a type", where)
    if kind == "base64":
        return ImageInput(where, data=source.get("data"), media_type=source.get("media_type"))
    if kind == "url":
        return ImageInput(where, url=source.get("url"))
    if kind == "file":
        raise bad_request(
            f"{where}: file sources (the Files API) are not supported; send the image as a "
            "base64 source",
            where,
        )
    raise bad_request(f"{where}: unknown image source type {kind!r}; send a base64 source", where)


def _tool_result_content(block: Mapping[str, Any], where: str) -> str | list[Any]:
    """A tool result's content: text (its blocks joined by newlines), or, when it holds
    images (Claude Code's `Read` of a PNG), its text parts and images in order."""
    content = block.get("content", "")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of text and image blocks", where
        )
    parts: list[str | ImageInput] = []
    for j, inner in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = _block_type(inner, here)
        if kind == "image":
            parts.append(_image(inner, here))
        elif kind == "text":
            parts.append(_text_block(inner, here))
        else:
            raise bad_request(f"{here}: expected a 'text' or 'image' block, got '{kind}'", here)
    if all(isinstance(p, str) for p in parts):
        return "\n".join(p for p in parts if isinstance(p, str))
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


def _user_messages(
    content: str | list[dict[str, Any]], where: str, open_calls: set[str]
) -> list[dict[str, Any]]:
    """One Anthropic user message as OpenAI user and tool messages, in block order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not content:
        raise bad_request(f"{where}: a user message needs at least one content block", where)
    out: list[dict[str, Any]] = []
    text: list[Any] = []  # the user turn's text parts and images, in order
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        kind = _block_type(block, here)
        if kind == "text":
            text.append({"type": "text", "text": _text_block(block, here)})
            continue
        if kind == "image":
            text.append(_image(block, here))
            continue
        if kind != "tool_result":
            raise bad_request(f"{here}: a user message cannot hold a '{kind}' block", here)
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or call_id not in open_calls:
            raise bad_request(
                f"{here}: tool_result for {call_id!r} has no tool_use block with that id "
                "in the previous assistant message",
                here,
            )
        if text:
            out.append({"role": "user", "content": text})
            text = []
        out.append(
            {"role": "tool", "tool_call_id": call_id, "content": _tool_result_content(block, here)}
        )
    if text:
        out.append({"role": "user", "content": text})
    return out


def _thinking_text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("thinking", "")
    signature = block.get("signature", "")
    if not isinstance(text, str) or not isinstance(signature, str):
        raise bad_request(f"{where}: thinking and signature must be strings", where)
    if not text and signature:
        return unseal_reasoning(signature) or ""
    return text


def _assistant_message(content: str | list[dict[str, Any]], where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        kind = _block_type(block, here)
        if kind == "text":
            text.append(_text_block(block, here))
        elif kind == "thinking":
            reasoning.append(_thinking_text(block, here))
        elif kind == "redacted_thinking":
            continue  # opaque data from another server: nothing of it can be rendered
        elif kind == "tool_use":
            calls.append(_tool_call(block, here))
        else:
            raise bad_request(f"{here}: an assistant message cannot hold a '{kind}' block", here)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.id must be a non-empty string", where)
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be a non-empty string", where)
    if not isinstance(args, Mapping):
        raise bad_request(f"{where}.input must be an object", where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _system_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    if isinstance(req.system, str):
        return [{"role": "system", "content": req.system}] if req.system else []
    if not req.system:
        return []
    parts = [
        p for p in _text_parts(req.system, "system") if not p["text"].startswith(BILLING_HEADER)
    ]
    return [{"role": "system", "content": parts}] if parts else []


def _output_schema(req: CountTokensRequest) -> dict[str, Any] | None:
    fmt = req.output_config.format if req.output_config is not None else None
    return fmt.schema_ if fmt is not None else None


def openai_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages as OpenAI chat messages."""
    out = _system_messages(req)
    open_calls: set[str] = set()
    started = False
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}].content"
        if msg.role == "system":
            role = "developer" if started else "system"
            out.append({"role": role, "content": _text_parts(msg.content, where)})
        elif msg.role == "user":
            out.extend(_user_messages(msg.content, where, open_calls))
            open_calls = set()
        else:
            message = _assistant_message(msg.content, where)
            open_calls = {c["id"] for c in message.get("tool_calls", ())}
            out.append(message)
        started = started or msg.role != "system"
    if not started:
        raise bad_request("messages: at least one user message is required", "messages")
    if req.messages[-1].role == "assistant":
        raise bad_request(
            "messages: a final assistant message (response prefill) is not supported",
            "messages",
        )
    schema = _output_schema(req)
    return out if schema is None else with_response_format(out, schema)


def _tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in req.tools:
        if not tool.is_custom:
            warn_once(
                f"tool:{tool.type}",
                "leaving server tool %r (type %s) out of the prompt: it runs on Anthropic's "
                "servers, not here",
                tool.name,
                tool.type,
            )
            continue
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        out.append({"type": "function", "function": function})
    return out or None


def tool_choice(req: CountTokensRequest) -> ToolChoice:
    """`tool_choice` in the server's terms: `any` forces a call, `tool` names one."""
    choice = req.tool_choice
    if choice is None:
        return ToolChoice()
    parallel = not choice.disable_parallel_tool_use
    modes = {"any": "required", "tool": "named"}
    return ToolChoice(modes.get(choice.type, choice.type), choice.name, parallel, choice.type)


def _constraint(
    req: MessagesRequest, tools: Sequence[Mapping[str, Any]] | None
) -> OutputConstraint | None:
    """`tool_choice` any/tool forces calls; `output_config.format` forces JSON."""
    return answer_constraint(tools, tool_choice(req), _output_schema(req))


def _budget_effort(budget: int | None) -> str | None:
    """A thinking budget as a reasoning effort (the encoder's vocabulary)."""
    if budget is None:
        return None
    if budget < 4096:
        return "low"
    return "high" if budget < 32768 else "max"


def prompt_request(req: CountTokensRequest) -> PromptRequest:
    """What the chat stage renders for this request."""
    tools = _tools(req)
    check_tool_choice(tools, tool_choice(req))
    kwargs: dict[str, Any] = {}
    effort: str | None = None
    if req.thinking is not None:
        enabled = req.thinking.type != "disabled"
        kwargs = {"thinking": enabled, "enable_thinking": enabled}
        if req.thinking.type == "enabled":
            effort = _budget_effort(req.thinking.budget_tokens)
    if req.output_config is not None and req.output_config.effort is not None:
        effort = req.output_config.effort
    return PromptRequest(
        messages=openai_messages(req),
        tools=tools,
        reasoning_effort=effort,
        chat_template_kwargs=kwargs,
    )


def to_generation(req: MessagesRequest) -> ChatGeneration:
    """A Messages request in the server's internal terms."""
    choice = req.tool_choice
    sampling = Sampling(
        max_tokens=req.max_tokens,
        clamp_max_tokens=True,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
    )
    prompt = prompt_request(req)
    return ChatGeneration(
        prompt=prompt,
        sampling=sampling,
        stops=tuple(s for s in req.stop_sequences or () if s),
        tools_enabled=bool(req.tools) and (choice is None or choice.type != "none"),
        parallel_tool_calls=tool_choice(req).parallel_calls,
        stream=bool(req.stream),
        constraint=_constraint(req, prompt.tools),
    )


def show_thinking(req: MessagesRequest) -> bool:
    """Whether thinking text is sent (`display: "omitted"` sends only the signature)."""
    return req.thinking is None or req.thinking.display != "omitted"
