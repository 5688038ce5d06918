"""`mlxserve generate`: a plain single-sequence greedy loop (the engine's oracle)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any, cast

import mlx.core as mx

from mlxserve.models.loaded import LoadedModel


def greedy_tokens(
    model: LoadedModel, prompt_ids: list[int], max_tokens: int, stop_at_eos: bool = True
) -> Iterator[int]:
    """Feed the whole prompt, then one token at a time, always taking the argmax."""
    cache: list[Any] = model.make_cache()
    logits = model.model.last_logits(mx.array([prompt_ids], dtype=mx.int32), cache)
    for _ in range(max_tokens):
        token = cast(int, mx.argmax(logits, axis=-1).item())
        yield token
        if stop_at_eos and token in model.eos_token_ids:
            return
        logits = model.model.last_logits(mx.array([[token]], dtype=mx.int32), cache)


def greedy_generate(
    model: LoadedModel, prompt_ids: list[int], max_tokens: int, stop_at_eos: bool = True
) -> list[int]:
    return list(greedy_tokens(model, prompt_ids, max_tokens, stop_at_eos))


def run(args: argparse.Namespace) -> int:
    from mlxserve.models.load import load
    from mlxserve.models.loaded import ModelLoadError
    from mlxserve.models.resolve import resolve_model

    if not args.demo and not args.model:
        print(
            "error: give a MODEL (a directory, a GGUF file or a Hugging Face ORG/NAME) or --demo",
            file=sys.stderr,
        )
        return 2
    try:
        if args.demo:
            from mlxserve.models.tiny.demo import demo_model_path

            path = demo_model_path(args.demo)
        else:
            path = resolve_model(args.model)
        model = load(path)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt_ids = model.tokenizer.encode(args.prompt)
    detokenizer = model.tokenizer.detokenizer
    detokenizer.reset()
    for token in greedy_tokens(model, prompt_ids, args.max_tokens):
        if token in model.eos_token_ids:
            break
        detokenizer.add_token(token)
        sys.stdout.write(detokenizer.last_segment)
        sys.stdout.flush()
    detokenizer.finalize()
    sys.stdout.write(detokenizer.last_segment + "\n")
    return 0
