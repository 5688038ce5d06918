"""The one prompt entry point the server calls: request -> prompt text and token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mlxserve.chat.deepseek_v4 import Variant, encode_request
from mlxserve.chat.images import ImagePart
from mlxserve.chat.messages import PromptError
from mlxserve.chat.template import render_template
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.prompt_format import PROGRAMMATIC_ENCODERS
from mlxserve.models.vision import PromptImage, VisionError, VisionTower

_VARIANTS: dict[str, Variant] = {"deepseek_v4": "v4", "deepseek_v41": "v41"}
# Effort names clients send (OpenAI, Anthropic) that V4.1's encoder has no level for:
# they select its low level, as V4's encoder treats them like "low".
_V41_EFFORT_ALIASES = {"minimal": "low", "medium": "low"}


@dataclass(frozen=True)
class PromptRequest:
    """What prompt rendering needs from a chat request.

    `messages` and `tools` are the client's OpenAI dicts. `reasoning_effort`
    is the top-level OpenAI field. `chat_template_kwargs`: for DeepSeek,
    `thinking` (default True; `enable_thinking` is accepted as an alias) and
    `drop_thinking` (default True); for templates, passed to the template.
    """

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    reasoning_effort: str | int | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptIds:
    """A rendered prompt and its token ids (ready for the engine)."""

    text: str
    token_ids: list[int]
    # Each image's place in `token_ids` (whose image positions hold content-keyed ids,
    # `models/vision.py`), for a model that reads images.
    images: tuple[PromptImage, ...] = ()


def deepseek_request(request: PromptRequest) -> dict[str, Any]:
    """A PromptRequest in the shape `encode_request` takes."""
    kwargs = request.chat_template_kwargs
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    out: dict[str, Any] = {
        "messages": request.messages,
        "tools": request.tools,
        "thinking": True if thinking is None else thinking,
        "reasoning_effort": request.reasoning_effort,
    }
    if "drop_thinking" in kwargs:
        out["drop_thinking"] = kwargs["drop_thinking"]
    return out


def render_text(model: LoadedModel, request: PromptRequest) -> str:
    """The prompt text for a request, by the model's chat encoder."""
    if model.chat_encoder in PROGRAMMATIC_ENCODERS:
        variant = _VARIANTS[model.chat_encoder]
        effort = request.reasoning_effort
        if variant == "v41" and isinstance(effort, str) and effort in _V41_EFFORT_ALIASES:
            request = replace(request, reasoning_effort=_V41_EFFORT_ALIASES[effort])
        return encode_request(deepseek_request(request), variant)
    if model.chat_encoder != "template":
        raise ValueError(f"unknown chat encoder {model.chat_encoder!r}")
    return render_template(
        model.tokenizer,
        request.messages,
        tools=request.tools,
        chat_template_kwargs=request.chat_template_kwargs,
        reasoning_effort=request.reasoning_effort,
    )


def render_prompt(model: LoadedModel, request: PromptRequest) -> PromptIds:
    """Render and tokenize a chat request. Raises PromptError for a bad request.

    DeepSeek prompts carry their own BOS, so no special tokens are added; a
    template's text is tokenized with special tokens only if it does not
    already start with the BOS token.
    """
    if not isinstance(request.chat_template_kwargs, Mapping):
        raise PromptError("'chat_template_kwargs' must be an object")
    if model.vision is not None:
        request, images = _image_placeholders(request, model.vision)
        if images:
            return _render_with_images(model, model.vision, request, images)
    text = render_text(model, request)
    if model.chat_encoder in PROGRAMMATIC_ENCODERS:
        add_special = False
    else:
        bos = getattr(model.tokenizer, "bos_token", None)
        add_special = not (isinstance(bos, str) and bos and text.startswith(bos))
    ids = model.tokenizer.encode(text, add_special_tokens=add_special)
    return PromptIds(text=text, token_ids=[int(i) for i in ids])


def _image_placeholders(
    request: PromptRequest, tower: VisionTower
) -> tuple[PromptRequest, list[ImagePart]]:
    """The request with each image as a text block holding the processor's placeholder,
    and the images in prompt order."""
    images: list[ImagePart] = []

    def place(part: Any) -> Any:
        if not isinstance(part, ImagePart):
            return part
        images.append(part)
        return {"type": "text", "text": tower.image_token}

    messages = []
    for msg in request.messages:
        content = msg.get("content")
        if isinstance(content, list) and any(isinstance(p, ImagePart) for p in content):
            placed = [place(p) for p in content]
            if tower.placeholder_joins_text:
                placed = _joined(placed)
            msg = {**msg, "content": placed}
        messages.append(msg)
    return replace(request, messages=messages), images


def _joined(parts: list[Any]) -> list[Any]:
    """A content list of text blocks as one block, its texts with nothing between: how
    mlx-vlm's processor renders a content list that holds images (DeepSeek-V4). Any
    other part leaves the list as it is, for the renderer to refuse."""
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type", "text") != "text":
            return parts
        if not isinstance(part.get("text"), str):
            return parts
        texts.append(part["text"])
    return [{"type": "text", "text": "".join(texts)}]


def _render_with_images(
    model: LoadedModel, tower: VisionTower, request: PromptRequest, images: list[ImagePart]
) -> PromptIds:
    """The chat template's text, then mlx-vlm's processor: it expands each placeholder
    to the image's token count and tokenizes, as the checkpoint's own pipeline does."""
    text = render_text(model, request)
    try:
        ids, placed = tower.prepare(text, [(image.data, image.sha256) for image in images])
    except VisionError as e:
        raise PromptError(str(e)) from e
    return PromptIds(text=text, token_ids=ids, images=tuple(placed))
