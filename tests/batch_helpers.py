"""Decode-batch parity helpers: requests decoded together vs each alone (greedy)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxserve.engine.decode_batch import DecodeBatch
from mlxserve.models.generate import greedy_generate
from mlxserve.models.loaded import LoadedModel

STEPS = 14


def prompt_ids(length: int, seed: int) -> list[int]:
    return [(37 * seed + 11 * i) % 250 + 3 for i in range(length)]


def argmax(logits: mx.array) -> list[int]:
    return [int(t) for t in mx.argmax(logits, axis=-1).tolist()]


def prefill(model: LoadedModel, prompt: list[int]) -> tuple[list[Any], int]:
    cache = model.make_cache()
    logits = model.model.last_logits(mx.array([prompt], dtype=mx.int32), cache)
    return cache, argmax(logits)[0]


def solo_tokens(model: LoadedModel, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each request's greedy tokens when it runs alone."""
    return {rid: greedy_generate(model, p, STEPS, stop_at_eos=False) for rid, p in prompts.items()}


def step(model: LoadedModel, batch: DecodeBatch, outputs: dict[str, list[int]]) -> None:
    inputs = mx.array([[outputs[rid][-1]] for rid in batch.request_ids], dtype=mx.int32)
    tokens = argmax(model.model.last_logits(inputs, batch.cache))
    for rid, token in zip(batch.request_ids, tokens, strict=True):
        outputs[rid].append(token)


def join(
    model: LoadedModel,
    batch: DecodeBatch,
    outputs: dict[str, list[int]],
    rid: str,
    prompt: list[int],
) -> None:
    cache, first = prefill(model, prompt)
    batch.add(rid, cache)
    outputs[rid] = [first]


def decode_together(model: LoadedModel, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    batch = DecodeBatch()
    outputs: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        join(model, batch, outputs, rid, prompt)
    for _ in range(STEPS - 1):
        step(model, batch, outputs)
    return outputs


def check_rows_join_and_leave(model: LoadedModel, lengths: dict[str, int]) -> None:
    """Rows a-f join and leave mid-batch; every row's tokens are its solo run's."""
    prompts = {rid: prompt_ids(n, i + 7) for i, (rid, n) in enumerate(lengths.items())}
    solo = solo_tokens(model, prompts)
    batch = DecodeBatch()
    outputs: dict[str, list[int]] = {}
    for rid in ("a", "b", "c"):
        join(model, batch, outputs, rid, prompts[rid])
    joins = {3: ["d", "e"], 6: ["f"]}
    leaves = {5: {"b"}, 9: {"a", "e"}}
    for number in range(1, 24):
        for rid in joins.get(number, []):
            join(model, batch, outputs, rid, prompts[rid])
        done = {r for r in batch.request_ids if len(outputs[r]) >= STEPS}
        batch.remove(leaves.get(number, set()) | done)
        if not batch.request_ids:
            break
        step(model, batch, outputs)
    for rid, tokens in outputs.items():
        assert tokens == solo[rid][: len(tokens)], rid
    assert all(len(outputs[rid]) == STEPS for rid in ("c", "d", "f"))
