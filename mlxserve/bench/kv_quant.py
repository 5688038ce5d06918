"""`mlxserve bench kv-quant`: what a quantized KV cache saves, and what it costs.

On a tiny plain-KV model with bfloat16 weights (so its cache is bfloat16)
and head size 64 (the default group size), each figure compares the 8-bit
(and 4-bit) cache with the full-precision one, side by side in one run:

- `kv_bytes_per_token_ratio_8` / `_4`: the memory probe's bytes per token
  (what admission charges), quantized over full precision.
- `sessions_admitted_ratio_8`: requests of `--session-tokens` tokens whose
  caches fit at once in one budget (the full-precision cost of four of them),
  by the scheduler's own arithmetic (`KVBudget.total`, as `_fits` uses it).
- `peak_bytes_ratio_8`: the allocator's peak above what was held before, over
  one `--long-tokens` request through the engine (chunked prefill, then decode).
- `decode_tok_s_ratio_8` / `_4`: decode steps per second of a batch of four over
  quantized caches against full-precision ones (the CPU figure; Metal's differs).

On a trained model (SmolLM2-135M-Instruct, from its GGUF; `--quality-tokens
0` skips it), the fixed text of `kv_quant_text.py` is teacher-forced through
a full-precision cache and through 8- and 4-bit ones: `top1_agreement_8` /
`_4` (share of positions with the same greedy choice) and `mean_kl_8` / `_4`
(mean KL divergence from the full-precision distribution, nats per position),
all in groups of 64 (the default), and `_4_g32` in groups of 32. The 4-bit
cache quantizes keys per channel (`models/channel_cache.py`); `_4_per_position`
is mlx-lm's own 4-bit layout (each position's keys on their own, groups of 64),
which that replaced, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxserve.bench.report import emit
from mlxserve.cache.arrays import cache_arrays
from mlxserve.config import EngineConfig
from mlxserve.engine.budget import CacheCost
from mlxserve.engine.cost_probe import probe_cost
from mlxserve.engine.decode_batch import DecodeBatch
from mlxserve.engine.request import SamplingParams
from mlxserve.kv_quant import DEFAULT_GROUP_SIZE, KVQuant
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.quantized_cache import apply_kv_quant

MODES: dict[str, KVQuant | None] = {"full": None, "8": KVQuant(8), "4": KVQuant(4)}
# Quality also at 4 bits in groups of 32: what the README advises where 4 bits are needed.
QUALITY_MODES = {**MODES, "4_g32": KVQuant(4, 32)}
# The budget of the sessions figure: what this many full-precision sessions take.
BUDGET_SESSIONS = 4
RESERVE_TOKENS = 64
QUALITY_CHUNK = 256


def tiny_head64_model(out: Path, layers: int = 4) -> Path:
    """A random-weight llama (hidden 128, two heads of 64, one KV head) in bfloat16.

    Made by `make-model` and re-shaped in its config: 2 heads x 64 is the same
    128 query columns as 4 x 32, and 1 KV head x 64 the same 64 as 2 x 32."""
    from mlxserve.models.tiny.synthetic import make_model

    make_model(out, "llama", seed=0, layers=layers, hidden=128)
    config = json.loads((out / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = mx.load(str(out / "model.safetensors"))
    assert isinstance(weights, dict)
    bf16 = {name: w.astype(mx.bfloat16) for name, w in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), bf16, metadata={"format": "mlx"})
    return out


def _sessions(cost: CacheCost, budget: int, tokens: int, limit: int = 1024) -> int:
    """How many requests of `tokens` tokens (plus the admission reserve) fit at once."""
    count = 0
    while count < limit and cost.total([tokens + RESERVE_TOKENS] * (count + 1), True) <= budget:
        count += 1
    return count


def memory_figures(model: LoadedModel, session_tokens: int) -> dict[str, Any]:
    costs = {name: probe_cost(apply_kv_quant(model, spec), True) for name, spec in MODES.items()}
    full = costs["full"]
    budget = full.total([session_tokens + RESERVE_TOKENS] * BUDGET_SESSIONS, True)
    sessions = {name: _sessions(cost, budget, session_tokens) for name, cost in costs.items()}
    return {
        "kv_bytes_per_token_full": full.bytes_per_token,
        "kv_bytes_per_token_8": costs["8"].bytes_per_token,
        "kv_bytes_per_token_4": costs["4"].bytes_per_token,
        "kv_bytes_per_token_ratio_8": costs["8"].bytes_per_token / full.bytes_per_token,
        "kv_bytes_per_token_ratio_4": costs["4"].bytes_per_token / full.bytes_per_token,
        "sessions_budget_bytes": budget,
        "sessions_admitted_full": sessions["full"],
        "sessions_admitted_8": sessions["8"],
        "sessions_admitted_4": sessions["4"],
        "sessions_admitted_ratio_8": sessions["8"] / max(1, sessions["full"]),
    }


async def _peak_of_one_request(path: Path, spec: KVQuant | None, prompt: list[int]) -> int:
    """Allocator peak above what was held once the engine was ready, over one request."""
    from mlxserve.engine.async_engine import AsyncEngine

    bits = None if spec is None else spec.bits
    config = EngineConfig(prefix_cache=False, kv_cache_bits=bits)
    engine = AsyncEngine(config, lambda: load(path))
    engine.start()
    await engine.wait_ready(timeout=600)
    try:
        mx.clear_cache()
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        async for _ in engine.submit(prompt, SamplingParams(max_tokens=16)):
            pass
        return int(mx.get_peak_memory() - held)
    finally:
        await engine.shutdown()


def peak_figures(path: Path, long_tokens: int) -> dict[str, Any]:
    prompt = [(i * 7919 + 13) % 100_000 + 100 for i in range(long_tokens)]
    peaks = {
        name: asyncio.run(_peak_of_one_request(path, MODES[name], prompt)) for name in ("full", "8")
    }
    return {
        "long_tokens": long_tokens,
        "peak_bytes_full": peaks["full"],
        "peak_bytes_8": peaks["8"],
        "peak_bytes_ratio_8": peaks["8"] / peaks["full"],
    }


def _decode_rate(model: LoadedModel, prompts: list[list[int]], steps: int) -> float:
    batch = DecodeBatch()
    for i, prompt in enumerate(prompts):
        cache = model.make_cache()
        mx.eval(model.model.last_logits(mx.array([prompt]), cache))
        batch.add(str(i), cache)
    tokens = mx.array([[p[-1]] for p in prompts])
    mx.eval(model.model.last_logits(tokens, batch.cache))  # warm-up step
    started = time.perf_counter()
    for _ in range(steps):
        logits = model.model.last_logits(tokens, batch.cache)
        tokens = mx.argmax(logits, axis=-1, keepdims=True).astype(mx.int32)
        mx.eval(tokens)
    return steps / (time.perf_counter() - started)


def decode_figures(model: LoadedModel, context: int, steps: int, rounds: int = 3) -> dict[str, Any]:
    """Batch of four at `context` tokens; rounds alternate which side runs first."""
    prompts = [[(i * 131 + r * 977 + 11) % 100_000 + 100 for i in range(context)] for r in range(4)]
    models = {name: apply_kv_quant(model, spec) for name, spec in MODES.items()}
    ratios: dict[str, list[float]] = {"8": [], "4": []}
    rates: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        order = list(models.items())
        for name, m in order if r % 2 == 0 else order[::-1]:
            rates[name].append(_decode_rate(m, prompts, steps))
        for name, ratio in ratios.items():
            ratio.append(rates[name][-1] / rates["full"][-1])
    figures: dict[str, Any] = {"decode_context_tokens": context}
    for name, rate in rates.items():
        figures[f"decode_tok_s_{name}"] = 4 * statistics.median(rate)
    for name, ratio in ratios.items():
        figures[f"decode_tok_s_ratio_{name}"] = statistics.median(ratio)
    return figures


def _number(scalar: mx.array) -> float:
    value: Any = scalar.item()
    return float(value)


def _teacher_forced(
    models: dict[str, LoadedModel], tokens: list[int], chunk: int
) -> dict[str, tuple[float, float]]:
    """Per quantized mode: (top-1 agreement, mean KL) with the full-precision cache."""
    caches = {name: m.make_cache() for name, m in models.items()}
    agree = {name: 0.0 for name in models if name != "full"}
    kl = dict(agree)
    inputs, positions = tokens[:-1], len(tokens) - 1
    for start in range(0, positions, chunk):
        window = mx.array([inputs[start : start + chunk]])
        logprobs = {}
        for name, m in models.items():
            logits = m.model(window, cache=caches[name])[0].astype(mx.float32)
            logprobs[name] = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        reference = logprobs.pop("full")
        best = mx.argmax(reference, axis=-1)
        for name, lp in logprobs.items():
            agree[name] += _number(mx.sum(mx.argmax(lp, axis=-1) == best))
            kl[name] += _number(mx.sum(mx.exp(reference) * (reference - lp)))
        mx.eval(cache_arrays([c for layers in caches.values() for c in layers]))
    return {name: (agree[name] / positions, kl[name] / positions) for name in agree}


def quality_figures(model_dir: Path, count: int) -> dict[str, Any]:
    from mlxserve.bench.kv_quant_text import TEXT

    model = load(model_dir)
    tokens = list(model.tokenizer.encode(TEXT))[: count + 1]
    if len(tokens) < count + 1:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than {count + 1}")
    models = {name: apply_kv_quant(model, spec) for name, spec in QUALITY_MODES.items()}
    models["4_per_position"] = _per_position(model, bits=4, group_size=DEFAULT_GROUP_SIZE)
    measured = _teacher_forced(models, tokens, QUALITY_CHUNK)
    figures: dict[str, Any] = {"quality_model": model_dir.name, "quality_tokens": count}
    for name, (agreement, divergence) in measured.items():
        figures[f"top1_agreement_{name}"] = agreement
        figures[f"mean_kl_{name}"] = divergence
    return figures


def _per_position(model: LoadedModel, bits: int, group_size: int) -> LoadedModel:
    """`model` over mlx-lm's own quantized cache (keys quantized per position)."""

    def make_cache() -> list[Any]:
        return [
            c.to_quantized(group_size=group_size, bits=bits) if type(c) is KVCache else c
            for c in model.make_cache()
        ]

    return replace(model, make_cache=make_cache)


def _smollm2_dir() -> Path:
    from mlxserve.models.gguf import convert_gguf
    from mlxserve.models.tiny.demo import smollm2_gguf

    return convert_gguf(smollm2_gguf())


def measure(
    path: Path, args: argparse.Namespace, quality_dir: Callable[[], Path] = _smollm2_dir
) -> dict[str, Any]:
    model = load(path)
    figures: dict[str, Any] = {"model_type": model.model_type}
    figures.update(memory_figures(model, args.session_tokens))
    figures.update(peak_figures(path, args.long_tokens))
    figures.update(decode_figures(model, args.decode_context, args.decode_steps))
    if args.quality_tokens > 0:
        figures.update(quality_figures(quality_dir(), args.quality_tokens))
    return figures


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else tiny_head64_model(Path(tmp) / "llama-h64")
        figures = measure(path, args)
    emit("kv-quant", figures, args.json)
    return 0
