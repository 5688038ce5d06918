"""Which models `mlxserve serve` serves: the positional MODEL, `--model NAME=SOURCE`
(repeatable) or a `--models-config` TOML file."""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A name may not be empty or hold a comma or '=' (the --model syntax's separators).
_NAME = re.compile(r"^[^,=\s][^,=]*$")
_PARSER_KEYS = ("tool_call_parser", "reasoning_parser", "chat_encoder", "images_for_text_models")
_KV_KEYS = ("kv_cache_bits", "kv_cache_group_size", "kv_quantize_after")
_CONFIG_KEYS = {"name", "path", "aliases", *_PARSER_KEYS, *_KV_KEYS}


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: its name, the names it also answers to, and where it lives."""

    name: str
    source: str
    aliases: tuple[str, ...] = ()
    # Per-model overrides of --tool-call-parser / --reasoning-parser / --chat-encoder.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_encoder: str | None = None
    # Per-model override of --images-for-text-models (refuse or placeholder).
    images_for_text_models: str | None = None
    # Per-model overrides of --kv-cache-bits (0: full precision) and its companions.
    kv_cache_bits: int | None = None
    kv_cache_group_size: int | None = None
    kv_quantize_after: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *(a for a in self.aliases if a != self.name))


def parse_model_option(text: str) -> ModelSpec:
    """`NAME[,ALIAS...]=PATH_OR_ID` (the value of one --model)."""
    names, sep, source = text.partition("=")
    if not sep or not source.strip():
        raise ValueError(f"--model takes NAME=PATH_OR_ID (NAME,ALIAS,...=PATH_OR_ID), not {text!r}")
    parts = [n.strip() for n in names.split(",")]
    for name in parts:
        _check_name(name, f"--model {text}")
    return ModelSpec(parts[0], source.strip(), tuple(parts[1:]))


def read_models_config(path: str) -> tuple[list[ModelSpec], str | None]:
    """The models of a TOML file (`[[model]]` tables) and its `default`, if it names one."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--models-config {path}: {e}") from e
    tables = data.get("model")
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"--models-config {path}: no [[model]] tables")
    default = data.get("default")
    if default is not None and not isinstance(default, str):
        raise ValueError(f"--models-config {path}: default must be a model name")
    return [_spec_from_table(t, path) for t in tables], default


def _spec_from_table(table: Any, path: str) -> ModelSpec:
    where = f"--models-config {path}"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: each [[model]] must be a table")
    unknown = set(table) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_CONFIG_KEYS)})")
    name, source = table.get("name"), table.get("path")
    if not isinstance(name, str) or not isinstance(source, str) or not source:
        raise ValueError(f"{where}: each [[model]] needs a name and a path")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"{where}: aliases of {name!r} must be a list of names")
    for each in (name, *aliases):
        _check_name(each, where)
    options = {k: table.get(k) for k in _PARSER_KEYS}
    for key, value in options.items():
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}: {key} of {name!r} must be a string")
    numbers = {k: table.get(k) for k in _KV_KEYS}
    for key, value in numbers.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{where}: {key} of {name!r} must be an integer")
    return ModelSpec(name, source, tuple(aliases), **options, **numbers)


def _check_name(name: str, where: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"{where}: {name!r} is not a model name")


def model_specs(args: argparse.Namespace) -> tuple[list[ModelSpec], str | None]:
    """The models these `serve` arguments name, and the default (None: the first).

    A server given neither --model nor --models-config serves the positional
    MODEL (or --demo) under --served-model-name, as one model.
    """
    options = list(getattr(args, "model_specs", None) or [])
    config = getattr(args, "models_config", None)
    default = getattr(args, "default_model", None)
    if not options and config is None:
        return [_single(args)], default
    if args.model or args.demo or args.served_model_name:
        raise ValueError(
            "give either MODEL (with --served-model-name) or --model / --models-config, not both"
        )
    specs = [parse_model_option(text) for text in options]
    if config is not None:
        listed, named_default = read_models_config(config)
        specs += listed
        default = default or named_default
    seen: set[str] = set()
    for spec in specs:
        for name in spec.names:
            if name in seen:
                raise ValueError(f"the model name {name!r} is given twice")
            seen.add(name)
    if default is not None and default not in seen:
        raise ValueError(f"--default-model {default!r} names none of the served models")
    return specs, default


def _single(args: argparse.Namespace) -> ModelSpec:
    names = tuple(args.served_model_name or ())
    if names:
        name = names[0]
    elif args.demo:
        name = "mlxserve-demo"
    else:
        name = str(args.model or "mlxserve")
    return ModelSpec(name, str(args.model or ""), names[1:])
