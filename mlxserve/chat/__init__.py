"""chat stage (see docs/architecture.md): render a chat request into prompt text and token ids.

`render_prompt(model, PromptRequest(...))` is the entry point; it uses the
DeepSeek-V4/V4.1 encoder (`encode_request`) or the tokenizer's chat template,
as `choose_encoder` decided at load time (`check_renderable` fails the load
when neither fits). Bad requests raise `PromptError` (a ValueError -> HTTP 400).
"""

from mlxserve.chat.deepseek_v4 import encode_request
from mlxserve.chat.messages import (
    AssistantMessage,
    DeveloperMessage,
    Message,
    PromptError,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
    normalise_messages,
)
from mlxserve.chat.render import (
    PromptIds,
    PromptRequest,
    render_prompt,
    render_text,
)
from mlxserve.chat.template import render_template
from mlxserve.models.prompt_format import check_renderable, choose_encoder

__all__ = [
    "AssistantMessage",
    "DeveloperMessage",
    "Message",
    "PromptError",
    "PromptIds",
    "PromptRequest",
    "SystemMessage",
    "ToolCall",
    "ToolMessage",
    "UserMessage",
    "check_renderable",
    "choose_encoder",
    "encode_request",
    "normalise_messages",
    "render_prompt",
    "render_template",
    "render_text",
]
