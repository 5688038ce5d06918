"""`mlxserve bench disk-cache`: an 8-turn agent session across a restart, on 4-bit models.

Each turn sends the whole conversation so far (a long history, then each
turn's reply and a tool result appended) and generates a short reply. The
engine (all RAM state) is shut down after turn 4 and a new one is started on
the same `--prefix-cache-dir`, so turns 5-8 can only hit what the disk tier
kept. Reported, per model and for the worst model:

- `hits` (turns 2-8 that reused a cached prefix, of 7) and
  `hits_after_restart` (of turns 5-8);
- `restored_ttft_over_cold`: turn 5's TTFT from disk over the same prompt
  prefilled cold; `restored_ttft_over_ram_hit`: over the same prompt served
  from a RAM hit (both measured in this run);
- `disk_bytes` against `disk_budget_bytes`;
- `warm_turn_ttft_s`: the median TTFT of the RAM-hit turns of the plain-KV
  (Qwen3) session.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mlxserve.bench.prefix_cache import TimedRequest, synthetic_tokens, timed_request
from mlxserve.bench.report import emit
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.models.load import load, read_config

TURNS = 8
RESTART_AFTER = 4
REPLY_TOKENS = 32
TOOL_RESULT_TOKENS = 200
CONVERTERS = {"deepseek_v4": "mlx_vlm", "qwen3": "mlx_lm"}
PLAIN_KV = ("qwen3", "llama")


def quantized_tiny(family: str, root: Path) -> Path:
    """A tiny random-weight checkpoint of `family`, converted to 4 bits by its converter."""
    from mlxserve.models.tiny.synthetic import make_model

    source = make_model(root / f"{family}-hf", family, seed=0)
    out = root / f"{family}-4bit"
    argv = ["-m", CONVERTERS[family], "convert", "--hf-path", str(source)]
    done = subprocess.run(
        [sys.executable, *argv, "--mlx-path", str(out), "-q"], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"converting {family} to 4 bits failed: {done.stderr[-2000:]}")
    return out


async def _turn(engine: AsyncEngine, prompt: list[int]) -> TimedRequest:
    return await timed_request(engine, prompt, REPLY_TOKENS)


async def _started(path: Path, config: EngineConfig) -> AsyncEngine:
    engine = AsyncEngine(config, lambda: load(path))
    engine.start()
    await engine.wait_ready(timeout=600)
    return engine


async def _session(path: Path, config: EngineConfig, system_tokens: int) -> dict[str, Any]:
    """The 8 turns with a restart after turn 4: per-turn TTFT and cached tokens, prompts."""
    engine = await _started(path, config)
    vocab = engine.model.vocab_size
    prompt = synthetic_tokens(10, system_tokens, vocab)
    prompts, ttfts, cached = [], [], []
    disk: dict[str, Any] = {}
    try:
        for turn in range(TURNS):
            if turn == RESTART_AFTER:
                await engine.shutdown()
                engine = await _started(path, config)
            prompts.append(prompt)
            ttft, reply, hit = await _turn(engine, prompt)
            ttfts.append(ttft)
            cached.append(hit)
            prompt = prompt + reply + synthetic_tokens(20 + turn, TOOL_RESULT_TOKENS, vocab)
        disk = engine.stats()["prefix_cache_disk"] or {}
    finally:
        await engine.shutdown()
    return {"prompts": prompts, "ttfts": ttfts, "cached": cached, "disk": disk}


async def _reference_ttfts(path: Path, prompts: list[list[int]]) -> tuple[float, float]:
    """Turn 5's prompt cold (no prefix cache) and from a RAM hit on turn 4's entry."""
    restored_turn = RESTART_AFTER
    cold_engine = await _started(path, EngineConfig(prefix_cache=False))
    try:
        cold, _, _ = await _turn(cold_engine, prompts[restored_turn])
    finally:
        await cold_engine.shutdown()
    ram_engine = await _started(path, EngineConfig())
    try:
        await _turn(ram_engine, prompts[restored_turn - 1])
        ram_hit, _, _ = await _turn(ram_engine, prompts[restored_turn])
    finally:
        await ram_engine.shutdown()
    return cold, ram_hit


def _measure(path: Path, family: str, args: argparse.Namespace, disk_dir: Path) -> dict[str, Any]:
    per_turn = REPLY_TOKENS + TOOL_RESULT_TOKENS
    system_tokens = max(256, args.history_tokens - RESTART_AFTER * per_turn)
    config = EngineConfig(prefix_cache_dir=str(disk_dir), prefix_cache_disk_bytes=args.disk_bytes)
    session = asyncio.run(_session(path, config, system_tokens))
    cold, ram_hit = asyncio.run(_reference_ttfts(path, session["prompts"]))
    ttfts, cached = session["ttfts"], session["cached"]
    restored = ttfts[RESTART_AFTER]
    ram_turns = [t for i, t in enumerate(ttfts) if i not in (0, RESTART_AFTER)]
    return {
        "family": family,
        "turn5_prompt_tokens": len(session["prompts"][RESTART_AFTER]),
        "hits": sum(1 for c in cached[1:] if c > 0),
        "hits_after_restart": sum(1 for c in cached[RESTART_AFTER:] if c > 0),
        "cached_tokens_per_turn": cached,
        "restored_ttft_s": restored,
        "cold_ttft_s": cold,
        "ram_hit_ttft_s": ram_hit,
        "restored_ttft_over_cold": restored / cold,
        "restored_ttft_over_ram_hit": restored / ram_hit,
        "warm_turn_ttft_s": statistics.median(ram_turns),
        "disk_bytes": int(session["disk"].get("bytes", 0)),
        "disk_entries": int(session["disk"].get("entries", 0)),
        "disk_restore_s": float(session["disk"].get("last_restore_s", 0.0)),
    }


def _summary(results: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """The contracted keys: the worst model's figure, then each model's, prefixed."""
    figures: dict[str, Any] = {
        "models": ",".join(r["family"] for r in results),
        "hits": min(r["hits"] for r in results),
        "hits_after_restart": min(r["hits_after_restart"] for r in results),
        "restored_ttft_over_cold": max(r["restored_ttft_over_cold"] for r in results),
        "restored_ttft_over_ram_hit": max(r["restored_ttft_over_ram_hit"] for r in results),
        "disk_bytes": max(r["disk_bytes"] for r in results),
        "disk_budget_bytes": budget,
    }
    plain = [r for r in results if r["family"] in PLAIN_KV]
    if plain:
        figures["warm_turn_ttft_s"] = plain[0]["warm_turn_ttft_s"]
    for r in results:
        for key, value in r.items():
            if key != "family":
                figures[f"{r['family']}.{key}"] = value
    return figures


def run(args: argparse.Namespace) -> int:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.model:
            family = str(read_config(Path(args.model)).get("model_type", "model"))
            targets = [(family, Path(args.model))]
        else:
            families = [f for f in args.families.split(",") if f]
            targets = [(f, quantized_tiny(f, root)) for f in families]
        for family, path in targets:
            results.append(_measure(path, family, args, root / f"disk-{family}"))
    emit("disk-cache", _summary(results, args.disk_bytes), args.json)
    return 0
