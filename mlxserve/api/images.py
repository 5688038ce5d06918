"""Images on every route: each dialect's image parts, checked, then placed or refused.

A dialect's converter leaves an `ImageInput` (what the client sent, unchecked)
in place of each image part of a chat message's content list. `settle_images`
runs in the render worker thread, since decoding is CPU work: it counts the images against
`--max-images-per-request`, checks each one (`chat.images.check_image`) and then,
for a model that reads text only, refuses the request or puts each image's note
in its place (`--images-for-text-models`). Every failure is an `APIError` 400
that names the part, so each dialect answers it in its own error shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mlxserve.api.errors import APIError
from mlxserve.chat import PromptRequest
from mlxserve.chat.images import (
    ImageError,
    ImageInput,
    ImageLimits,
    ImagePart,
    check_image,
)
from mlxserve.config import ServerConfig

IMAGE_CODE = "invalid_image"
TOO_MANY_CODE = "too_many_images"
TEXT_ONLY_CODE = "model_reads_text_only"
# `count(outcome, n)`: the metrics' tally of what became of a request's images.
ImageCounter = Callable[[str, int], None]


@dataclass(frozen=True)
class ImagePolicy:
    """What one served model does with images: the limits and the text-only mode."""

    limits: ImageLimits = field(default_factory=ImageLimits)
    text_models: str = "refuse"

    @classmethod
    def of(cls, config: ServerConfig) -> ImagePolicy:
        limits = ImageLimits(config.max_image_pixels, config.max_images_per_request)
        return cls(limits, config.images_for_text_models)


def image_error(e: ImageError, code: str = IMAGE_CODE) -> APIError:
    return APIError(400, str(e), param=e.where, code=code)


def no_count(outcome: str, n: int) -> None:
    return None


def _found(messages: Sequence[Mapping[str, Any]]) -> list[ImageInput]:
    return [
        part
        for msg in messages
        if isinstance(content := msg.get("content"), list)
        for part in content
        if isinstance(part, ImageInput)
    ]


def settle_images(
    prompt: PromptRequest,
    *,
    model_name: str,
    reads_images: bool,
    policy: ImagePolicy,
    count: ImageCounter = no_count,
) -> PromptRequest:
    """The prompt with its images checked and placed: as `ImagePart`s for a model that
    reads images, as their notes in placeholder mode; else a 400 naming the part."""
    images = _found(prompt.messages)
    if not images:
        return prompt
    limit = policy.limits.max_images
    if len(images) > limit:
        count("over_limit", len(images))
        extra = images[limit]
        raise image_error(
            ImageError(
                f"too many images: the request holds {len(images)}, the limit is {limit} "
                "(--max-images-per-request)",
                extra.where,
            ),
            TOO_MANY_CODE,
        )
    checked: dict[int, ImagePart] = {}
    for n, image in enumerate(images):
        try:
            checked[id(image)] = check_image(image, policy.limits)
        except ImageError as e:
            count("invalid", 1)
            count("skipped", len(images) - n - 1)
            raise image_error(e) from e
    if not reads_images and policy.text_models != "placeholder":
        count("refused", len(images))
        first = images[0].where
        raise APIError(
            400,
            f"{first}: the model '{model_name}' reads text only and cannot take images "
            "(a server started with --images-for-text-models placeholder puts a short "
            "note in each image's place instead)",
            param=first,
            code=TEXT_ONLY_CODE,
        )
    count("accepted" if reads_images else "placeholder", len(images))
    return replace(prompt, messages=_placed(prompt.messages, checked, reads_images))


def _placed(
    messages: Sequence[Mapping[str, Any]], checked: Mapping[int, ImagePart], reads_images: bool
) -> list[Mapping[str, Any]]:
    def place(part: Any) -> Any:
        if not isinstance(part, ImageInput):
            return part
        image = checked[id(part)]
        return image if reads_images else {"type": "text", "text": image.note()}

    out: list[Mapping[str, Any]] = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list) and any(isinstance(p, ImageInput) for p in content):
            msg = {**msg, "content": [place(p) for p in content]}
        out.append(msg)
    return out
