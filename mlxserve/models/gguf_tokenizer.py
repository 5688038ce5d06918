"""A GGUF file's tokenizer written out as `tokenizer.json` + `tokenizer_config.json`.

A GGUF carries no tokenizer files: llama.cpp stores the vocabulary, merges,
token types and special ids as metadata (`tokenizer.ggml.*`) and the chat
template as `tokenizer.chat_template`. transformers' GGUF support turns those
fields into a `tokenizers.Tokenizer` (byte-level BPE for `gpt2` vocabularies,
sentencepiece BPE for `llama` ones, with the pre-tokenizer split each
`tokenizer.ggml.pre` names); we call it with the metadata MLX has already
read (its own GGUF reader needs PyTorch, which is not installed) and write
the files mlx-lm's tokenizer loader reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxserve.models.loaded import ModelLoadError

# GGUF key (after "tokenizer.ggml.") -> the name transformers' converter reads it under.
_TOKENIZER_FIELDS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def plain(value: Any) -> Any:
    """A metadata value as Python: MLX arrays (scalars and vectors) become ints, floats, lists."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


# Where transformers keeps `convert_gguf_tokenizer(architecture, fields)`: its 5.x releases
# first, earlier ones after (the same signature).
_CONVERTER_MODULES = (
    "transformers.integrations.gguf.gguf_tokenizer_mapping",
    "transformers.integrations.ggml",
)


def _converter() -> Any:
    import importlib

    errors = []
    for name in _CONVERTER_MODULES:
        try:
            return importlib.import_module(name).convert_gguf_tokenizer
        except (ImportError, AttributeError) as e:
            errors.append(f"{name}: {e}")
    raise ModelLoadError(
        "building a tokenizer from GGUF metadata needs transformers' GGUF support, "
        f"which this transformers lacks ({'; '.join(errors)})"
    )


def tokenizer_fields(metadata: dict[str, Any]) -> dict[str, Any]:
    """The `tokenizer.ggml.*` fields, under the names transformers' converter reads."""
    fields = {
        name: plain(metadata[f"tokenizer.ggml.{key}"])
        for key, name in _TOKENIZER_FIELDS.items()
        if f"tokenizer.ggml.{key}" in metadata
    }
    if not fields.get("tokens"):
        raise ModelLoadError("the GGUF file has no vocabulary (tokenizer.ggml.tokens)")
    return fields


def write_tokenizer(metadata: dict[str, Any], architecture: str, out: Path) -> dict[str, Any]:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out`; returns the config."""
    fields = tokenizer_fields(metadata)
    try:
        backend, _ = _converter()(architecture, fields)
    except (ValueError, KeyError, TypeError) as e:
        kind = fields.get("tokenizer_type")
        raise ModelLoadError(f"cannot build the GGUF file's {kind!r} tokenizer: {e}") from e
    backend.save(str(out / "tokenizer.json"))
    tokens: list[str] = fields["tokens"]
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in _SPECIAL_TOKENS.items():
        token_id = plain(metadata.get(f"tokenizer.ggml.{key}"))
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    for flag in ("add_bos_token", "add_eos_token"):
        value = plain(metadata.get(f"tokenizer.ggml.{flag}"))
        if isinstance(value, bool):
            config[flag] = value
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return config
