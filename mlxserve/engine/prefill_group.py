"""Prefill the whole prompts of several requests in one left-padded forward.

mlx-lm's `BatchKVCache` takes left-padded rows: row i's padding is masked and
its positions start at 0 after it, so each row computes what it would alone.
The runner groups the chunks that are a request's whole prompt on a fresh
plain-KV cache (no prefix-cache hit, nothing fed yet), the common case when
several short requests arrive together; each row's cache is then extracted
as the request's own and joins the decode batch at the next run like any
finished prefill. Padding is bounded: rows join a group only while the padded
forward stays within `MAX_PADDING` times the real tokens.

Fault points are checked per row before the forward, so an injected fault
still touches one request; a forward that raises falls back to solo prefills,
so a bad request fails alone.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxserve.engine import faults
from mlxserve.engine.plan import PrefillChunk, RequestOutput, StepResult

if TYPE_CHECKING:
    from mlxserve.engine.runner import Runner

logger = logging.getLogger(__name__)

# A group's padded forward feeds at most this many times its real tokens.
MAX_PADDING = 1.5


def _groupable(runner: Runner, chunk: PrefillChunk) -> bool:
    rid = chunk.request.request_id
    return (
        chunk.start == 0
        and chunk.is_last
        and chunk.initial_cache is None
        and rid not in runner.caches
    )


def _pick(chunks: list[PrefillChunk]) -> list[PrefillChunk]:
    """The longest prompts first, while the padding stays bounded."""
    group: list[PrefillChunk] = []
    real = 0
    for chunk in sorted(chunks, key=lambda c: -c.num_tokens):
        longest = group[0].num_tokens if group else chunk.num_tokens
        if (len(group) + 1) * longest > MAX_PADDING * (real + chunk.num_tokens):
            continue
        group.append(chunk)
        real += chunk.num_tokens
    return group


def prefill_group(
    runner: Runner, chunks: list[PrefillChunk], result: StepResult
) -> list[PrefillChunk]:
    """Run what can be grouped; return the chunks left for solo prefills, in order."""
    group = _pick([c for c in chunks if _groupable(runner, c)])
    ready = []
    for chunk in group:
        rid = chunk.request.request_id
        try:
            runner.ensure_sampler(chunk.request)
            runner._check(faults.FORWARD, [rid])
            runner._check(faults.SAMPLE, [rid])
        except Exception as e:  # a failing step fails its request, not the engine
            logger.exception("prefill failed for request %s", rid)
            runner._forget([rid])
            result.outputs.append(RequestOutput(rid, error=f"{type(e).__name__}: {e}"))
            continue
        ready.append(chunk)
    done = {id(c) for c in group} - {id(c) for c in ready}
    if len(ready) >= 2 and _forward(runner, ready, result):
        done |= {id(c) for c in ready}
    return [c for c in chunks if id(c) not in done]


def _forward(runner: Runner, group: list[PrefillChunk], result: StepResult) -> bool:
    """One forward over the group; False (nothing changed) if it raised."""
    lengths = [c.num_tokens for c in group]
    width = max(lengths)
    pads = [width - n for n in lengths]
    rows = [[0] * pad + c.request.context_ids[: c.end] for pad, c in zip(pads, group, strict=True)]
    layers = len(runner.model.make_cache())
    cache = [BatchKVCache(pads) for _ in range(layers)]
    requests = [c.request for c in group]
    started = time.perf_counter()
    try:
        logits = runner.model.model.last_logits(mx.array(rows, dtype=mx.int32), cache)
        sampled = runner._sample(logits, requests, check=False)
    except Exception:  # each request is tried alone instead, so a bad one fails alone
        logger.warning(
            "a grouped prefill of %d requests failed; prefilling each alone",
            len(group),
            exc_info=True,
        )
        mx.clear_cache()
        return False
    result.prefill_chunks.append((width * len(group), time.perf_counter() - started))
    for i, (chunk, row) in enumerate(zip(group, sampled, strict=True)):
        rid = chunk.request.request_id
        result.prefill_tokens += chunk.num_tokens
        output = RequestOutput(rid, sampled=row, computed=chunk.end)
        try:
            own = [layer.extract(i) for layer in cache]
            runner.caches[rid] = own
            if chunk.snapshot_after:
                key = chunk.request.context_ids[: chunk.end]
                output.snapshot = runner._own_snapshot(rid, key)
            runner.joining.append(rid)
        except Exception as e:  # a failing step fails its request, not the engine
            logger.exception("prefill failed for request %s", rid)
            runner._forget([rid])
            output = RequestOutput(rid, error=f"{type(e).__name__}: {e}")
        result.outputs.append(output)
    return True
