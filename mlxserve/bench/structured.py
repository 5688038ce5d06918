"""`mlxserve bench structured`: the cost of constrained decoding, side by side.

The same requests run free and under a JSON-schema grammar (a string field
that may not close before 4096 characters, so both sides produce the same
number of tokens) at 1 and 8 concurrent requests, on the tiny DeepSeek-V4 and
Qwen3 checkpoints (built on the spot, or given with `--model FAMILY=DIR`). Each
round measures both sides back to back, the side that goes first alternating from
round to round (a machine that speeds up or slows down over the run then favours
neither); a figure is the median of the rounds' ratios.
Figures: `constrained_over_free_1`, `constrained_over_free_8` (aggregate decode
tokens/s, constrained over free; the worst family), each family's figures and
its rounds' ratios (`<family>_rounds_<n>`), and `mask_ms_p99` (one grammar
mask, measured alone).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxserve.api.structured import json_schema_grammar
from mlxserve.bench.report import emit
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.constraint import ConstraintState, GrammarTokenizer
from mlxserve.engine.request import Constraint, SamplingParams
from mlxserve.models.load import load
from mlxserve.models.tiny.synthetic import make_model

FAMILIES = ("deepseek_v4", "qwen3")
# Single rounds' ratios swing by 10-25% on a shared 2-core machine: five rounds (the
# default of `--rounds`) give a median that one slow round cannot move.
# The string may not close before this many characters, so a constrained request runs
# to `max_tokens` as a free one does (random weights close a plain string at once).
MIN_TEXT_CHARS = 4096
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": MIN_TEXT_CHARS}},
    "required": ["text"],
}


async def stream_times(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams
) -> tuple[float, float, int]:
    """(first token time, last token time, tokens) of one request."""
    first = last = 0.0
    tokens = 0
    async for event in engine.submit(prompt, params):
        if event.token_id is None:
            continue
        now = time.perf_counter()
        first = first or now
        last = now
        tokens += 1
    return first, last, tokens


async def aggregate_rate(
    engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams
) -> float:
    """Decode tokens/s of the requests together, from when every one has its first token."""
    results = await asyncio.gather(*(stream_times(engine, p, params) for p in prompts))
    start = max(r[0] for r in results)  # every row is decoding from here on
    end = max(r[1] for r in results)
    return (sum(r[2] for r in results) - len(prompts)) / max(end - start, 1e-9)


async def _rate(engine: AsyncEngine, concurrency: int, params: SamplingParams) -> float:
    prompts = [[5 + 11 * i + j for j in range(32)] for i in range(concurrency)]
    return await aggregate_rate(engine, prompts, params)


async def _round_ratio(
    engine: AsyncEngine,
    concurrency: int,
    free: SamplingParams,
    constrained: SamplingParams,
    constrained_first: bool,
) -> float:
    """Constrained over free tokens/s, the two measured back to back in the given order."""
    if constrained_first:
        constrained_rate = await _rate(engine, concurrency, constrained)
        free_rate = await _rate(engine, concurrency, free)
    else:
        free_rate = await _rate(engine, concurrency, free)
        constrained_rate = await _rate(engine, concurrency, constrained)
    return constrained_rate / free_rate


async def _family(path: Path, tokens: int, rounds: int) -> dict[str, Any]:
    engine = AsyncEngine(EngineConfig(prefix_cache=False, max_num_seqs=8), lambda: load(path))
    engine.start()
    await engine.wait_ready()
    grammar = Constraint(json_schema_grammar(SCHEMA))
    free = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, constraint=grammar)
    out: dict[str, Any] = {}
    try:
        await _rate(engine, 1, constrained)  # warm-up: the first grammar, the first steps
        for concurrency in (1, 8):
            ratios = [
                await _round_ratio(engine, concurrency, free, constrained, constrained_first)
                for constrained_first in [i % 2 == 1 for i in range(rounds)]
            ]
            out[f"constrained_over_free_{concurrency}"] = statistics.median(ratios)
            out[f"rounds_{concurrency}"] = [round(r, 3) for r in ratios]
    finally:
        await engine.shutdown()
    return out


def _mask_ms_p99(path: Path, steps: int = 300) -> float:
    """One mask (bitmask + conversion to a vocabulary mask), timed alone."""
    model = load(path)
    grammar = GrammarTokenizer(path / "tokenizer.json", model.vocab_size, min(model.eos_token_ids))
    state = ConstraintState(Constraint(json_schema_grammar(SCHEMA)), grammar)
    opening = model.tokenizer.encode('{"text": "', add_special_tokens=False)
    for token in opening:
        state.advance(int(token))
    letter = int(model.tokenizer.encode("a", add_special_tokens=False)[0])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mx.eval(state.allowed(model.vocab_size))
        times.append((time.perf_counter() - start) * 1000)
        state.advance(letter)
    return sorted(times)[int(0.99 * (len(times) - 1))]


def _checkpoints(given: list[str] | None) -> dict[str, Path]:
    """`--model FAMILY=DIR` checkpoints by family (each of FAMILIES at most once)."""
    paths: dict[str, Path] = {}
    for item in given or []:
        family, sep, folder = item.partition("=")
        if not sep or family not in FAMILIES or family in paths:
            raise SystemExit(f"--model takes FAMILY=DIR once per family of {FAMILIES}: {item!r}")
        paths[family] = Path(folder)
    return paths


def run(args: argparse.Namespace) -> int:
    figures: dict[str, Any] = {}
    worst: dict[str, float] = {}
    given = _checkpoints(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {f: given.get(f) or make_model(Path(tmp) / f, f) for f in FAMILIES}
        for family, path in paths.items():
            result = asyncio.run(_family(path, args.tokens, args.rounds))
            for key, value in result.items():
                figures[f"{family}_{key}"] = value
                if key.startswith("constrained_over_free"):
                    worst[key] = min(worst.get(key, value), value)
        figures.update(worst)
        figures["mask_ms_p99"] = _mask_ms_p99(paths[FAMILIES[0]])
    figures["tokens"] = args.tokens
    figures["rounds"] = args.rounds
    emit("structured", figures, args.json)
    return 0
