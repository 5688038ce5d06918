"""Which prompt renderer a checkpoint needs, decided (and checked) when it loads.

DeepSeek-V4 and V4.1 ship no chat template: their prompts come from a
programmatic encoder (`chat/deepseek_v4.py`). Every other family renders with
its tokenizer's Jinja template, so one without a template cannot be served. A
fact about the checkpoint, so it lives here; `chat/` renders with it.
"""

from __future__ import annotations

from typing import Any

from mlxserve.models.loaded import LoadedModel, ModelLoadError

__all__ = [
    "ENCODERS",
    "PROGRAMMATIC_ENCODERS",
    "check_renderable",
    "choose_encoder",
    "has_chat_template",
]

PROGRAMMATIC_ENCODERS = frozenset({"deepseek_v4", "deepseek_v41"})
ENCODERS = ("deepseek_v4", "deepseek_v41", "template")


def choose_encoder(model_type: str, override: str = "auto") -> str:
    """The prompt renderer for a model: "deepseek_v4", "deepseek_v41" or "template".

    `override` is `--chat-encoder`; "auto" picks by the model's `model_type`.
    """
    if override != "auto":
        if override not in ENCODERS:
            raise ValueError(
                f"--chat-encoder {override!r} is not one of auto, {', '.join(ENCODERS)}"
            )
        return override
    if model_type in PROGRAMMATIC_ENCODERS:
        return model_type
    return "template"


def has_chat_template(tokenizer: Any) -> bool:
    """Whether a tokenizer (HF, or mlx-lm's TokenizerWrapper) can render chats."""
    flag = getattr(tokenizer, "has_chat_template", None)
    if isinstance(flag, bool):
        return flag
    return getattr(tokenizer, "chat_template", None) is not None


def check_renderable(model: LoadedModel) -> None:
    """Fail the load (never fall back silently) if no prompt renderer fits the model."""
    encoder = model.chat_encoder
    if encoder in PROGRAMMATIC_ENCODERS:
        return
    if encoder != "template":
        raise ModelLoadError(
            f"unknown chat encoder {encoder!r}; expected deepseek_v4, deepseek_v41 or template"
        )
    if not has_chat_template(model.tokenizer):
        raise ModelLoadError(
            f"model {model.path} (model_type {model.model_type!r}) has no chat template in its "
            "tokenizer_config.json / chat_template.jinja and no built-in prompt encoder; add a "
            "chat template to the model directory or pass --chat-encoder deepseek_v4|deepseek_v41"
        )
