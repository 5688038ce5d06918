"""Request schema of the OpenAI Responses API (`POST /v1/responses`), pydantic v2.

Types are strict (a string where an integer belongs is a 400); unknown
fields are accepted and ignored (Codex sends `client_metadata`, the Agents
SDK `service_tier`, newer clients newer fields). Input items and tools stay
dicts here: `convert` checks them one by one so an error names
the item (`input[3].call_id`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from mlxserve.api.body import Strict, TopLogprobs
from mlxserve.api.errors import APIError

TOOL_CHOICE_MODES = frozenset({"auto", "none", "required"})
# `include` asks for the output text's token log-probabilities with this.
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class ReasoningConfig(Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextConfig(Strict):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: TopLogprobs = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(value, str) and value not in TOOL_CHOICE_MODES:
            raise ValueError("tool_choice must be 'auto', 'none', 'required' or an object")
        return value

    @field_validator("max_output_tokens")
    @classmethod
    def _max_output_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("max_output_tokens must be at least 1")
        return value

    def check_supported(self) -> None:
        if self.background:
            raise APIError(400, "background responses are not supported", param="background")
        if self.conversation is not None:
            raise APIError(
                400,
                "conversations are not supported; use previous_response_id or send the items",
                param="conversation",
            )

    @property
    def stores(self) -> bool:
        """Whether this response is kept for `previous_response_id` (the API's default)."""
        return self.store is not False

    @property
    def include_encrypted(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or ())

    @property
    def include_logprobs(self) -> bool:
        """Whether output text carries token log-probabilities (`top_logprobs` alone does
        not ask for them: it says how many alternatives each one lists)."""
        return INCLUDE_LOGPROBS in (self.include or ())
