"""The typed result of loading a model directory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxserve.models.vision import VisionTower


def directory_signature(path: Path) -> tuple[Any, ...] | None:
    """A checkpoint directory as what was read from it: its resolved path and its
    files' names, sizes and mtimes (None where it cannot be read). What is derived
    from a directory may be reused while its signature is the same."""
    try:
        files = tuple(
            sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir())
        )
    except OSError:
        return None
    return (str(path.resolve()), files)


class ModelLoadError(RuntimeError):
    """A model directory cannot be loaded; the message names the problem."""


@dataclass
class LoadedModel:
    """Everything the server needs from a model directory.

    `model(inputs, cache=cache)` takes a (batch, length) int32 array and
    returns (batch, length, vocab) logits (DeepSeek-V4's mlx-vlm output is
    adapted to that). `tokenizer` is mlx-lm's `TokenizerWrapper` (HF tokenizer
    plus a streaming detokenizer). `chat_encoder` names the prompt renderer:
    "deepseek_v4", "deepseek_v41" or "template".
    """

    model: Any
    tokenizer: Any
    model_type: str
    path: Path
    config: dict[str, Any]
    make_cache: Callable[[], list[Any]]
    eos_token_ids: frozenset[int]
    chat_encoder: str
    vocab_size: int
    # Prefill chunks shorter than this cost more than one this long (see
    # `load.min_prefill_chunk`), so the scheduler does not cut shorter ones.
    min_prefill_chunk: int = 1
    # Whether the model has a vision tower its prompts can place images for (`vision`);
    # for any other model every image meets the server's --images-for-text-models policy.
    reads_images: bool = False
    # The vision tower and its processor (`models/vision.py`), or None.
    vision: VisionTower | None = None
    extra: dict[str, Any] = field(default_factory=dict)
