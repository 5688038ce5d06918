"""`mlxserve bench speculative`: prompt-lookup drafts on a copy-heavy reply and on noise.

Two workloads, each run with and without `--speculative ngram`, alternating
sides each round, on the tiny Qwen3 checkpoint converted to 4 bits:

- **copy**: the reply re-emits a 400-token file from its own prompt, as an
  edit does. The model is the real 4-bit model with the reply laid over its
  logits (`CopyOverlay`), so every position a verify forward feeds costs a
  real forward position, not only fewer Python steps.
- **adversarial**: the random-weight model as it is: nothing it writes is in
  its prompt, so drafts are rare and rejected.

Figures: `tokens_per_forward_copy` (per verify forward of one row),
`ngram_speedup_copy` and `ngram_speedup_adversarial` (single-stream decode
tokens/s, with over without), `batch4_speedup_copy` (four copy streams at
once, aggregate tokens/s) and the acceptance rate.

Then DeepSeek-V4's MTP drafter (`--speculative mtp`), on the tiny random-weight
DeepSeek-V4 with an MTP layer (or `--mtp-model`): `mtp_parity` is 1 when greedy
tokens with MTP drafts equal those without, and `mtp_acceptance` /
`mtp_tokens_per_forward` say how often its drafts were right (random weights:
almost never, so drafting pauses and backs off).

`--real` measures prompt lookup on a trained model instead (`speculative_real.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxserve.bench.disk_cache import quantized_tiny
from mlxserve.bench.report import emit
from mlxserve.bench.structured import aggregate_rate
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import SamplingParams
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel

FILE_TOKENS = 400
HEADER_TOKENS = 8
FORCED_LOGIT = 100.0


class CopyOverlay:
    """A model adapter whose logits are the real model's plus a forced reply.

    The reply is `reply` then EOS, starting after `prompt_len` prompt tokens;
    positions come from the cache's offset (every row's prompt is as long).
    """

    def __init__(self, inner: Any, reply: list[int], prompt_len: int, eos: int, vocab: int):
        self.inner = inner
        table = [eos] * (prompt_len + len(reply) + 1)
        table[prompt_len - 1 : prompt_len - 1 + len(reply)] = reply
        self.table = mx.array(table, dtype=mx.int32)
        self.vocab = vocab

    def _forced(self, inputs: mx.array, cache: list[Any], last_only: bool) -> mx.array:
        """(B, L, V) forced logits of each input position (L = 1 with `last_only`)."""
        batch, length = inputs.shape
        offset = cache[0].offset  # tokens the cache held before this call, per row
        start = offset if isinstance(offset, mx.array) else mx.full((batch,), offset)
        steps = mx.array([length - 1]) if last_only else mx.arange(length)
        positions = start[:, None] + steps[None, :]
        targets = self.table[mx.clip(positions, 0, self.table.size - 1)]
        hit = mx.arange(self.vocab)[None, None, :] == targets[..., None]
        return hit.astype(mx.float32) * FORCED_LOGIT

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        forced = self._forced(inputs, cache, last_only=False)
        return self.inner(inputs, cache) + forced

    def last_logits(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        forced = self._forced(inputs, cache, last_only=True)[:, 0, :]
        return self.inner.last_logits(inputs, cache) + forced

    def make_cache(self) -> list[Any]:
        return self.inner.make_cache()


def _copy_model(path: Path, prompt_len: int, reply: list[int]) -> LoadedModel:
    model = load(path)
    eos = min(model.eos_token_ids)
    model.model = CopyOverlay(model.model, reply, prompt_len, eos, model.vocab_size)
    return model


def _file(seed: int, length: int = FILE_TOKENS) -> list[int]:
    """400 tokens of a file: a few recurring tokens (indentation, punctuation) among
    mostly distinct ones, so its 3-token runs rarely repeat, as in real source."""
    common = [220, 11, 13, 25]
    return [
        common[i % 4] if i % 5 == 4 else 1000 + (seed * 997 + i * 37) % 60000 for i in range(length)
    ]


MTP_PROMPTS = 3
MTP_TOKENS = 48


async def _greedy_tokens(
    path: Path, speculative: str, k: int, tokens: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy tokens of a few prompts, one after another, and the drafts' stats."""
    engine = await _engine(lambda: load(path), speculative, k)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    try:
        outputs = []
        for i in range(MTP_PROMPTS):
            prompt = [(i * 31 + j * 7) % 500 + 10 for j in range(12 + 9 * i)]
            events = [e async for e in engine.submit(prompt, params)]
            outputs.append([e.token_id for e in events if e.token_id is not None])
        return outputs, dict(engine.stats()["speculative"] or {})
    finally:
        await engine.shutdown()


async def _measure_mtp(path: Path, k: int, tokens: int = MTP_TOKENS) -> dict[str, Any]:
    plain, _ = await _greedy_tokens(path, "off", k, tokens)
    drafted, stats = await _greedy_tokens(path, "mtp", k, tokens)
    proposed = stats.get("draft_tokens", 0)
    return {
        "mtp_parity": int(plain == drafted),
        "mtp_draft_tokens": proposed,
        "mtp_acceptance": stats.get("accepted_tokens", 0) / proposed if proposed else 0.0,
        "mtp_tokens_per_forward": stats.get("tokens_per_forward", 0.0),
    }


async def _engine(loader: Any, speculative: str, k: int) -> AsyncEngine:
    config = EngineConfig(prefix_cache=False, speculative=speculative, num_draft_tokens=k)
    engine = AsyncEngine(config, loader)
    engine.start()
    await engine.wait_ready(timeout=600)
    return engine


async def _side_by_side(
    loader: Any, prompts: list[list[int]], params: SamplingParams, k: int, rounds: int
) -> tuple[float, dict[str, Any]]:
    """Median over rounds of (tokens/s with drafts) / (without), and the drafts' stats."""
    plain, drafted = await _engine(loader, "off", k), await _engine(loader, "ngram", k)
    try:
        await aggregate_rate(plain, prompts[:1], params)  # warm-up
        await aggregate_rate(drafted, prompts[:1], params)
        ratios = []
        for _ in range(rounds):
            without = await aggregate_rate(plain, prompts, params)
            with_drafts = await aggregate_rate(drafted, prompts, params)
            ratios.append(with_drafts / without)
        return statistics.median(ratios), dict(drafted.stats()["speculative"] or {})
    finally:
        await plain.shutdown()
        await drafted.shutdown()


async def _measure(path: Path, k: int, file_tokens: int, rounds: int) -> dict[str, Any]:
    text = _file(0, file_tokens)
    prompt_len = HEADER_TOKENS + file_tokens + 4
    prompts = [[50 + row] * HEADER_TOKENS + text + [7, 8, 9, 10] for row in range(4)]
    copy = SamplingParams(max_tokens=file_tokens + 8, temperature=0.0)

    def copy_loader() -> LoadedModel:
        return _copy_model(path, prompt_len, text)

    single, stats = await _side_by_side(copy_loader, prompts[:1], copy, k, rounds)
    batch, _ = await _side_by_side(copy_loader, prompts, copy, k, rounds)
    noise = SamplingParams(max_tokens=file_tokens // 3, temperature=0.0, ignore_eos=True)
    adversarial, noise_stats = await _side_by_side(
        lambda: load(path), [[11 + 3 * i for i in range(64)]], noise, k, rounds
    )
    drafted = stats.get("draft_tokens", 0)
    return {
        "tokens_per_forward_copy": stats.get("tokens_per_forward", 0.0),
        "acceptance_copy": stats.get("accepted_tokens", 0) / drafted if drafted else 0.0,
        "ngram_speedup_copy": single,
        "batch4_speedup_copy": batch,
        "ngram_speedup_adversarial": adversarial,
        "draft_tokens_adversarial": noise_stats.get("draft_tokens", 0),
        "num_draft_tokens": k,
    }


def run(args: argparse.Namespace) -> int:
    from mlxserve.models.tiny.synthetic import make_model

    k = args.num_draft_tokens
    if getattr(args, "real", False):
        from mlxserve.bench.speculative_real import measure_real

        figures = measure_real(k)
        figures["backend"] = "gpu" if mx.default_device() == mx.gpu else "cpu"
        emit("speculative-real", figures, args.json)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else quantized_tiny("qwen3", Path(tmp))
        figures = asyncio.run(_measure(path, k, args.file_tokens, args.rounds))
        mtp_path = Path(args.mtp_model) if args.mtp_model else None
        if mtp_path is None:
            mtp_path = make_model(Path(tmp) / "v4-mtp", "deepseek_v4", mtp_layers=1)
        figures.update(asyncio.run(_measure_mtp(mtp_path, k, args.mtp_tokens)))
    figures["backend"] = "gpu" if mx.default_device() == mx.gpu else "cpu"
    emit("speculative", figures, args.json)
    return 0
