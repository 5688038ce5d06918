"""Request schemas of the Anthropic Messages API (`/v1/messages`), pydantic v2.

Types are strict (a string where an integer belongs is a 400), unknown fields
are accepted and ignored the way the real API tolerates new client fields
(Claude Code sends `context_management`, `output_config`, beta fields).
Content blocks stay dicts here: `convert` checks them one by one so
an error names the block (`messages[2].content[0]`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from mlxserve.api.body import Strict

MAX_STOP_SEQUENCES = 16


class AnthropicMessage(Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class AnthropicTool(Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None

    @property
    def is_custom(self) -> bool:
        """A client-side tool (the model calls it, the client runs it)."""
        return self.type in (None, "custom") and self.input_schema is not None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(Strict):
    """The prompt-shaping fields of a Messages request (all `/v1/messages/count_tokens` takes)."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[AnthropicMessage]) -> list[AnthropicMessage]:
        if not value:
            raise ValueError("messages: at least one message is required")
        return value


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int) -> int:
        if value < 1:
            raise ValueError("max_tokens must be at least 1")
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop_sequences")
        return value
