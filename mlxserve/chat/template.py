"""Prompt rendering through the tokenizer's own (Jinja) chat template.

Every model without a programmatic encoder goes here. Messages are normalised
first (so bad input fails the same way for every model), then handed to the
template natively: tool messages stay `role: "tool"`, tool-call arguments are
decoded objects (many templates iterate `arguments.items()`), reasoning is
`reasoning_content`. `chat_template_kwargs` reach the template unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

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
from mlxserve.models.prompt_format import has_chat_template

# Arguments of `apply_chat_template` that are ours to set, not the client's.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def template_messages(raw: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as a chat template expects them (see module docstring).

    Raises PromptError for malformed messages, including tool-call arguments
    that are not a JSON object. `developer` becomes `system`, the role HF
    templates know.
    """
    return [_template_message(m) for m in normalise_messages(raw, join="\n")]


def _template_message(msg: Message) -> dict[str, Any]:
    if isinstance(msg, (SystemMessage, DeveloperMessage)):
        return {"role": "system", "content": msg.content}
    if isinstance(msg, UserMessage):
        out: dict[str, Any] = {"role": "user", "content": msg.content}
        if msg.name is not None:
            out["name"] = msg.name
        return out
    if isinstance(msg, ToolMessage):
        out = {"role": "tool", "content": msg.content}
        if msg.tool_call_id is not None:
            out["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            out["name"] = msg.name
        return out
    return _template_assistant(msg)


def _template_assistant(msg: AssistantMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": msg.content}
    if msg.reasoning is not None:
        out["reasoning_content"] = msg.reasoning
    if msg.tool_calls:
        out["tool_calls"] = [
            {
                **({"id": call.id} if call.id is not None else {}),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments or {}},
            }
            for call in msg.tool_calls
        ]
    return out


def render_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    reasoning_effort: str | int | None = None,
) -> str:
    """Render with `tokenizer.apply_chat_template(..., add_generation_prompt=True)`.

    `chat_template_kwargs` are passed through as template variables (for
    example `enable_thinking`); they may override `add_generation_prompt`.
    `reasoning_effort` is offered to the template as a variable too.
    """
    if not has_chat_template(tokenizer):
        raise PromptError("this model has no chat template; it cannot render chat messages")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise PromptError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    kwargs.setdefault("add_generation_prompt", True)
    if reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", reasoning_effort)
    conversation = template_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=list(tools) if tools else None, tokenize=False, **kwargs
        )
    except TemplateError as e:
        raise PromptError(f"the model's chat template rejected the request: {e}") from e
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text
