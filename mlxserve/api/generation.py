"""The one internal chat request every wire format converts to.

OpenAI chat completions, Anthropic Messages and OpenAI Responses each have a
pure converter from their request body to `ChatGeneration`; everything after
it (prompt rendering, sampling settings, the engine, the output pipeline) is
shared. `Sampling` is the client's sampling knobs before they are checked
against the model (token ids in range, the context limit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxserve.api.structured import OutputConstraint
from mlxserve.chat import PromptRequest

# The most alternatives a token's log-probability lists (OpenAI's limit on every route).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Sampling:
    """The client's sampling knobs; None means the server's default."""

    max_tokens: int | None = None
    # Anthropic clients ask for far more than any context (Claude Code: 128000):
    # clamp to what is left instead of answering 400.
    clamp_max_tokens: bool = False
    # What this route calls the prompt and the budget, for the 400 that names them.
    prompt_param: str = "messages"
    max_tokens_param: str = "max_tokens"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class ChatGeneration:
    """A chat request in the terms of this server, whatever dialect it came in."""

    prompt: PromptRequest
    sampling: Sampling = field(default_factory=Sampling)
    stops: tuple[str, ...] = ()
    tools_enabled: bool = False
    parallel_tool_calls: bool = True
    stream: bool = False
    # Structured output: the answer must be JSON under a schema, or forced tool calls.
    constraint: OutputConstraint | None = None
