"""OpenAI chat and text completion requests -> the internal request (pure functions).

Chat messages are already the shape the chat stage renders; what is
converted here is `image_url` parts (to `ImageInput`s, see `api/images.py`),
`tool_choice` and `response_format` (to the one `answer_constraint`), the
sampling fields, and a text prompt to token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from mlxserve.api.errors import APIError
from mlxserve.api.generation import ChatGeneration, Sampling
from mlxserve.api.openai.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from mlxserve.api.structured import OutputConstraint, ToolChoice, answer_constraint
from mlxserve.chat import PromptRequest
from mlxserve.chat.images import ImageInput
from mlxserve.models.loaded import LoadedModel

# The roles whose content may hold an image (OpenAI's own take them in user turns).
IMAGE_ROLES = frozenset({"user", "tool"})


def tool_choice(req: ChatCompletionRequest) -> ToolChoice:
    parallel = req.parallel_tool_calls is not False
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return ToolChoice("named", choice.function.name, parallel)
    return ToolChoice(choice or "auto", parallel=parallel, label=choice or "auto")


def response_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks for (None for plain text)."""
    fmt = req.response_format
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise APIError(
            400,
            f"response_format type {kind!r} is not one of text, json_object, json_schema",
            param="response_format",
        )
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError(
            400,
            "response_format json_schema needs json_schema.schema, a JSON schema object",
            param="response_format",
        )
    return schema


def tool_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def output_constraint(req: ChatCompletionRequest) -> OutputConstraint | None:
    """What the answer is forced to be (tool_choice required/named, response_format)."""
    tools = tool_dicts(req) if req.tool_choice != "none" else None
    return answer_constraint(tools, tool_choice(req), response_schema(req))


def _image_part(part: Mapping[str, Any], where: str) -> ImageInput:
    """An `image_url` part: `{"url": "data:..."}` (or the URL string itself); `detail`
    is accepted and ignored."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    if url is None:
        raise APIError(400, f"{where}: an image_url part needs image_url.url", param=where)
    return ImageInput(where, url=url)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The client's messages, each `image_url` part turned into an `ImageInput` in place
    (user and tool messages only); every other part is left for the chat stage."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(msg)
            continue
        if msg.get("role") not in IMAGE_ROLES:
            where = f"messages[{i}].content"
            raise APIError(
                400, f"{where}: only a user or tool message can hold an image", param=where
            )
        parts = [
            _image_part(p, f"messages[{i}].content[{j}]") if _is_image(p) else p
            for j, p in enumerate(content)
        ]
        out.append({**msg, "content": parts})
    return out


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image_url"


def chat_generation(req: ChatCompletionRequest) -> ChatGeneration:
    """A chat completion request in the server's internal terms."""
    tools = tool_dicts(req)
    prompt = PromptRequest(
        messages=chat_messages(req.messages),
        tools=tools,
        reasoning_effort=req.reasoning_effort,
        chat_template_kwargs=req.chat_template_kwargs or {},
    )
    max_tokens = req.max_completion_tokens
    sampling = replace(
        req.sampling(req.max_tokens if max_tokens is None else max_tokens),
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
    )
    return ChatGeneration(
        prompt=prompt,
        sampling=sampling,
        stops=tuple(req.stop_strings()),
        tools_enabled=bool(tools) and req.tool_choice != "none",
        parallel_tool_calls=tool_choice(req).parallel_calls,
        stream=bool(req.stream),
        constraint=output_constraint(req),
    )


def completion_sampling(req: CompletionRequest) -> Sampling:
    return replace(
        req.sampling(req.max_tokens),
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        prompt_param="prompt",
    )


def single_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of this request (a batch of prompts is refused)."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [int(x) for x in p]  # type: ignore[arg-type]
    if len(p) == 1:
        first = p[0]
        return first if isinstance(first, str) else [int(x) for x in first]  # type: ignore[union-attr]
    raise APIError(400, "a batch of several prompts is not supported", param="prompt")


def completion_ids(model: LoadedModel, req: CompletionRequest) -> list[int]:
    """The prompt's token ids: encoded text, or ids checked against the vocabulary."""
    prompt = single_prompt(req)
    if isinstance(prompt, str):
        ids = [int(i) for i in model.tokenizer.encode(prompt)]
    else:
        ids = prompt
        bad = [i for i in ids if not 0 <= i < model.vocab_size]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is out of range", param="prompt")
    if not ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return ids
