"""`mlxserve bench memory`: many long requests through a small KV byte budget.

N concurrent greedy requests run through an engine whose `--kv-memory-bytes`
fits only a few of them at their longest; some wait, some are preempted and
re-prefilled. The figures say whether the measured cache bytes stayed within
the budget, how many preemptions it took, and whether every request produced
the same tokens as a solo run of the same prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxserve.bench.report import emit
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load


@dataclass(frozen=True)
class Scenario:
    requests: int = 16
    prompt_tokens: int = 48
    max_tokens: int = 16
    # The budget holds this many requests at admission (longest prompt + reserve).
    fits: int = 4
    reserve_tokens: int = 4


def prompts(scenario: Scenario, vocab: int) -> list[list[int]]:
    """Distinct prompts of varied lengths around `prompt_tokens`."""
    out = []
    for j in range(scenario.requests):
        length = max(2, scenario.prompt_tokens - (j * 7) % (scenario.prompt_tokens // 2 + 1))
        out.append([(i * 131 + j * 977 + 11) % vocab for i in range(length)])
    return out


async def _run(path: Path, config: EngineConfig, batch: list[list[int]], n: int) -> Any:
    engine = AsyncEngine(config, lambda: load(path))
    engine.start()
    await engine.wait_ready()
    params = SamplingParams(max_tokens=n)

    async def one(prompt: list[int]) -> tuple[list[int], str | None]:
        tokens, finish = [], None
        async for event in engine.submit(prompt, params):
            if event.token_id is not None:
                tokens.append(event.token_id)
            finish = event.finish_reason or finish
        return tokens, finish

    try:
        results = await asyncio.gather(*(one(p) for p in batch))
        await asyncio.sleep(0.05)
        return results, engine.stats(), engine.open_requests()
    finally:
        await engine.shutdown()


def measure(path: Path, scenario: Scenario) -> dict[str, Any]:
    model = load(path)
    runner = Runner(model)
    cost = runner.probe_cost(reuse=True)
    batch = prompts(scenario, model.vocab_size)
    longest = max(len(p) for p in batch)
    rows = [longest + scenario.reserve_tokens + 2] * scenario.fits
    budget = cost.total(rows, batched=runner.batchable)
    config = EngineConfig(
        max_num_seqs=scenario.requests,
        kv_memory_bytes=budget,
        kv_reserve_tokens=scenario.reserve_tokens,
        prefix_cache_entries=8,
    )
    results, stats, left = asyncio.run(_run(path, config, batch, scenario.max_tokens))
    solo = [greedy_generate(model, p, scenario.max_tokens) for p in batch]
    finished = [finish for _, finish in results if finish in ("stop", "length")]
    return {
        "model_type": model.model_type,
        "requests": scenario.requests,
        "budget_bytes": budget,
        "peak_cache_bytes": stats["peak_cache_bytes"],
        "peak_over_budget": stats["peak_cache_bytes"] / budget,
        "preemptions": stats["preemptions"],
        "completed": len(finished),
        "greedy_identical": sum(
            tokens == expected for (tokens, _), expected in zip(results, solo, strict=True)
        ),
        "fixed_bytes": cost.fixed_bytes,
        "bytes_per_token": cost.bytes_per_token,
        "left_open": sum(left.values()),
    }


def run(args: argparse.Namespace) -> int:
    scenario = Scenario(
        requests=args.requests, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens
    )
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
        else:
            from mlxserve.models.tiny.synthetic import make_model

            path = make_model(Path(tmp) / "llama-h64", "llama", seed=0, hidden=64)
        figures = measure(path, scenario)
    emit("memory", figures, args.json)
    return 0
