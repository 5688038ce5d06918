"""The code that runs the model: prefill chunks, batched decode, sampling.

`run(plan)` is one step: free what finished, one forward over every decode
row, then the plan's prefill chunks. Decode rows and prefill chunks do not
share a forward: mlx-lm's batched caches advance every row by the same
length, so a decode row in a chunk's forward would be padded to the chunk's
length (docs/mixed-batches.md has the measurements). Requests prefill over
their own caches; a finished prefill joins the decode batch
(`decode_batch.py`) when every layer of its cache can be merged (mlx-lm's
plain and sliding-window KV caches, left-padded; DeepSeek-V4's and V4.1's
caches, see `models/deepseek_v4/`). Other caches decode as batches of one.

Decode runs in one of three modes (`DecodeMode`): plain; ahead, where a
step with no prefill beside it starts the next step's forward over the
tokens it is still drawing, so Python builds the next graph while this one
computes (`DecodeBatch.ahead`); overlap, where a step with prefill chunks
beside it is started before the first chunk's graph is built and its tokens
are read only then. Rows with drafts verify them (`spec/verify_step.py`).

Snapshots for the prefix cache are scheduled with `mx.async_eval` after the
step's tokens are sampled, so the copies overlap what follows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxserve.cache.arrays import cache_arrays, cache_nbytes
from mlxserve.engine import faults
from mlxserve.engine.budget import CacheCost
from mlxserve.engine.constraint import GrammarTokenizer
from mlxserve.engine.cost_probe import measured_once, probe_cost
from mlxserve.engine.decode_batch import DecodeBatch, DecodeMode, DecodeTokens, mergeable
from mlxserve.engine.faults import FaultHook
from mlxserve.engine.kv_quantize import (
    kv_quant_of,
    leading_pieces,
    quantized_probe_cost,
    settle,
)
from mlxserve.engine.plan import (
    FinishRule,
    PrefillChunk,
    RequestOutput,
    Snapshot,
    StepPlan,
    StepResult,
)
from mlxserve.engine.prefill_group import (
    GROUPABLE,
    GroupedPrefill,
    grouped_forward,
    pick_group,
)
from mlxserve.engine.request import Request
from mlxserve.engine.restores import advance_restores
from mlxserve.engine.sampling import (
    PendingLogits,
    PendingSample,
    SampledRow,
    SamplerState,
    new_sampler_state,
    pipelinable,
    record_token,
    sample_lazy,
    sample_rows,
)
from mlxserve.engine.snapshots import SnapshotTaker
from mlxserve.engine.spec.mtp_drafter import HiddenTap, decode_positions
from mlxserve.engine.spec.verify_step import VerifyStep
from mlxserve.engine.vision_inputs import VisionInputs
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.quantized_cache import query_heads

logger = logging.getLogger(__name__)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@dataclass
class _BuiltChunk:
    """A prefill chunk whose forward graph is built, not yet evaluated."""

    chunk: PrefillChunk
    cache: list[Any]
    logits: mx.array
    build_s: float


class Runner:
    def __init__(
        self, model: LoadedModel, fault: FaultHook | None = None, decode_ahead: bool = True
    ) -> None:
        self.model = model
        self.fault = fault
        # Start the next decode step before reading this one's tokens, where allowed.
        self.decode_ahead = decode_ahead
        probe = model.make_cache()
        # batchable: running requests decode as one batch over merged caches.
        self.batchable = (
            bool(probe)
            and all(mergeable(layer) for layer in probe)
            and model.extra.get("batchable", True)
        )
        # Completion (`prompt + output`) snapshots only for trimmable plain KV caches.
        self.completion_snapshots = self.batchable and all(type(c) in GROUPABLE for c in probe)
        # Whole short prompts prefill together, left-padded (plain KV caches only).
        self.group_prefill = self.completion_snapshots
        # A quantized cache (`--kv-cache-bits`); its prefill pieces follow the probe's cost.
        self.kv_quant = kv_quant_of(model)
        self.query_heads = query_heads(model.config)
        self.cost: CacheCost | None = None
        if not self.batchable:
            kinds = sorted({type(layer).__name__ for layer in probe})
            logger.warning(
                "%s caches (%s) cannot be merged into one batch: each request decodes "
                "as its own batch (correct, but decode does not scale with batch size)",
                model.model_type,
                ", ".join(kinds),
            )
        self.caches: dict[str, list[Any]] = {}
        # Prefilled requests that join the decode batch at the start of the next run
        # (merging waits until their first token is out).
        self.joining: list[str] = []
        self.batch = DecodeBatch()
        self.samplers: dict[str, SamplerState] = {}
        self.snapshots = SnapshotTaker(fault)
        self.vision = VisionInputs(model.vision)
        self.tap = HiddenTap(model)  # the forwards; an MTP drafter, if set, reads their states
        self.verify = VerifyStep(model, self.tap, probe, self.batchable, fault)
        eos = min(model.eos_token_ids) if model.eos_token_ids else 0
        self.grammar = GrammarTokenizer(model.path / "tokenizer.json", model.vocab_size, eos)

    # -- lifecycle ----------------------------------------------------------
    def release(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        gone = set(request_ids)
        try:
            self._check(faults.RELEASE, request_ids)
            self.batch.remove(gone)
        finally:
            self.joining = [rid for rid in self.joining if rid not in gone]
            self.vision.forget(gone)
            for request_id in gone:
                self.caches.pop(request_id, None)
                self.samplers.pop(request_id, None)

    def preempt(self, request_ids: list[str]) -> None:
        """Drop these requests' caches but keep their samplers (they resume later)."""
        if not request_ids:
            return
        self.batch.remove(set(request_ids))
        self.joining = [rid for rid in self.joining if rid not in request_ids]
        self.vision.forget(request_ids)
        for request_id in request_ids:
            self.caches.pop(request_id, None)

    def reset(self) -> None:
        """Forget every request (after a failure left the batch in an unknown state)."""
        self.caches.clear()
        self.joining = []
        self.samplers.clear()
        self.vision.clear()
        self.batch = DecodeBatch()
        mx.clear_cache()

    def live_bytes(self) -> int:
        """Bytes the live caches hold now (decode batch and per-request caches)."""
        return cache_nbytes([self.batch.cache, *self.caches.values()])

    def probe_cost(self, reuse: bool = False) -> CacheCost:
        """This model's cache bytes against its tokens (see `cost_probe.probe_cost`);
        with `reuse`, the cost measured before in this process for the same
        checkpoint and setting, if any (`cost_probe.measured_once`)."""

        def measure() -> CacheCost:
            if self.kv_quant is not None and self.kv_quant.quantize_after > 0:
                return quantized_probe_cost(self.model, self.batchable, self.kv_quant)
            return probe_cost(self.model, self.batchable)

        self.cost = measured_once(self.model, self.batchable, measure) if reuse else measure()
        return self.cost

    def run(self, plan: StepPlan) -> StepResult:
        """One step: free, decode every running row in one forward, feed the chunks."""
        result = StepResult()
        self._join(set(plan.released), result)
        try:
            if self.completion_snapshots:
                taken = self.snapshots.of_completed(plan.completed, self.batch, self.caches)
                result.outputs += [RequestOutput(rid, snapshot=snap) for rid, snap in taken]
        finally:
            self._release_finished(plan.released, result)
        self.preempt(plan.preempted)
        if result.unreleased:
            return result  # the decode batch may be inconsistent: the engine recovers first
        decoded = self._decode(plan, result) if plan.decodes else DecodeTokens()
        solo = plan.prefills
        if self.group_prefill and len(solo) > 1:
            decoded.read()
            solo = self._prefill_group(plan.prefills, result)
        for chunk in solo:
            built = self._build_chunk(chunk, result)
            decoded.read()  # the first chunk's graph is built: read the decode tokens now
            if built is not None:
                self._feed_chunk(built, result)
        decoded.read()
        advance_restores(plan.restores, result.restored)
        return result

    def _join(self, released: set[str], result: StepResult) -> None:
        """Merge last step's finished prefills into the decode batch (not those released)."""
        joining = [rid for rid in self.joining if rid not in released]
        self.joining = [rid for rid in self.joining if rid in released]
        for request_id in joining:
            try:
                cache = self.caches.pop(request_id)
                settle(cache, self.kv_quant, 0, joining=True)
                self.batch.add(request_id, cache)
            except Exception as e:  # a failing merge fails its request, not the step
                logger.exception("request %s could not join the decode batch", request_id)
                self._forget([request_id])
                result.outputs.append(RequestOutput(request_id, error=_describe(e)))

    def ensure_sampler(self, request: Request) -> None:
        if request.request_id not in self.samplers:
            self.samplers[request.request_id] = new_sampler_state(
                request.params, request.token_ids(request.prompt_ids), self.grammar
            )

    def _release_finished(self, request_ids: list[str], result: StepResult) -> None:
        try:
            self.release(request_ids)
        except Exception as e:  # reported; the engine recovers these requests
            logger.exception("freeing %d finished request(s) failed", len(request_ids))
            result.unreleased = list(request_ids)
            result.release_error = _describe(e)

    # -- prefill ------------------------------------------------------------
    def _prefill_group(self, chunks: list[PrefillChunk], result: StepResult) -> list[PrefillChunk]:
        """Whole fresh prompts in one forward (`prefill_group.py`); returns the chunks
        left for solo prefills, in order. Fault points are checked per row first."""

        def groupable(c: PrefillChunk) -> bool:
            first = c.start == 0 and c.is_last and c.initial_cache is None
            # A prompt with images is fed embeddings, chunk by chunk, alone.
            alone = bool(c.request.images)
            return first and not alone and c.request.request_id not in self.caches

        group = pick_group(chunks, groupable)
        ready = []
        for chunk in group:
            rid = chunk.request.request_id
            try:
                self.ensure_sampler(chunk.request)
                self._check(faults.FORWARD, [rid])
                self._check(faults.SAMPLE, [rid])
            except Exception as e:  # a failing step fails its request, not the engine
                logger.exception("prefill failed for request %s", rid)
                self._prefill_failed(rid, e, result)
                continue
            ready.append(chunk)
        done = {id(c) for c in group} - {id(c) for c in ready}
        if len(ready) >= 2 and self._grouped(ready, result):
            done |= {id(c) for c in ready}
        return [c for c in chunks if id(c) not in done]

    def _grouped(self, group: list[PrefillChunk], result: StepResult) -> bool:
        """Run and sample one grouped forward; False (nothing changed) if it raised."""
        started = time.perf_counter()
        try:
            forward: GroupedPrefill = grouped_forward(self.model, group)
            sampled = self._sample(forward.logits, [c.request for c in group], check=False)
        except Exception:  # each request is tried alone instead, so a bad one fails alone
            logger.warning(
                "a grouped prefill of %d requests failed; prefilling each alone",
                len(group),
                exc_info=True,
            )
            mx.clear_cache()
            return False
        result.prefill_chunks.append((forward.fed_tokens, time.perf_counter() - started))
        for row, (chunk, drawn) in enumerate(zip(group, sampled, strict=True)):
            rid = chunk.request.request_id
            result.prefill_tokens += chunk.num_tokens
            output = RequestOutput(rid, sampled=drawn, computed=chunk.end)
            try:
                self.caches[rid] = forward.row_cache(row)
                if chunk.snapshot_after:
                    key = chunk.request.context_ids[: chunk.end]
                    output.snapshot = self.snapshots.of_cache(rid, key, self.caches[rid])
                self.joining.append(rid)
            except Exception as e:  # a failing step fails its request, not the engine
                logger.exception("prefill failed for request %s", rid)
                self._forget([rid])
                output = RequestOutput(rid, error=_describe(e))
            result.outputs.append(output)
        return True

    def _build_chunk(self, chunk: PrefillChunk, result: StepResult) -> _BuiltChunk | None:
        """A chunk's forward, built but not evaluated (None: it failed, and is reported)."""
        rid = chunk.request.request_id
        try:
            cache = self.caches.get(rid)
            if cache is None:
                cache = chunk.initial_cache or self.model.make_cache()
                self.caches[rid] = cache
            self.ensure_sampler(chunk.request)
            ids = self.vision.model_ids(chunk.request, chunk.start, chunk.end)
            tokens = mx.array([ids], dtype=mx.int32)
            started = time.perf_counter()
            self._check(faults.FORWARD, [rid])
            start = self._feed_leading_pieces(chunk, cache)
            tokens = tokens[:, start - chunk.start :]
            embeddings = self.vision.embeddings(chunk.request, start, chunk.end)
            logits = self.tap.last_logits(tokens, cache, [(rid, start)], embeddings)
            return _BuiltChunk(chunk, cache, logits, time.perf_counter() - started)
        except Exception as e:  # a failing step fails its request, not the engine
            logger.exception("prefill failed for request %s", rid)
            self._prefill_failed(rid, e, result)
            return None

    def _feed_leading_pieces(self, chunk: PrefillChunk, cache: list[Any]) -> int:
        """Feed a long chunk's leading pieces over a quantized cache now
        (`kv_quantize.leading_pieces`); returns where the rest starts."""
        rid = chunk.request.request_id
        rest = chunk.start
        if chunk.request.holds_whole_span(chunk.start, chunk.end):  # one forward, never cut
            return rest
        for start, end in leading_pieces(chunk, self.kv_quant, self.cost, self.query_heads):
            inputs = mx.array([self.vision.model_ids(chunk.request, start, end)], dtype=mx.int32)
            embeddings = self.vision.embeddings(chunk.request, start, end)
            logits = self.tap.last_logits(inputs, cache, [(rid, start)], embeddings)
            self._feed_only(logits, cache)
            rest = end
        return rest

    def _feed_chunk(self, built: _BuiltChunk, result: StepResult) -> None:
        """Evaluate a built chunk; a prompt's last chunk also samples its first token."""
        chunk, cache = built.chunk, built.cache
        request = chunk.request
        rid = request.request_id
        try:
            started = time.perf_counter()
            self._feed_only(built.logits, cache)
            settle(cache, self.kv_quant, chunk.end, joining=False)
            # The pacer learns what feeding costs; a prompt's last chunk also runs
            # the head, which the others skip, so it is timed before the head.
            elapsed = built.build_s + time.perf_counter() - started
            result.prefill_chunks.append((chunk.num_tokens, elapsed))
            output = RequestOutput(rid, computed=chunk.end)
            if chunk.is_last:
                self.vision.forget([rid])
                output.sampled = self._sample(built.logits, [request])[0]
            result.prefill_tokens += chunk.num_tokens
            if chunk.snapshot_after:
                key = request.context_ids[: chunk.end]
                output.snapshot = self.snapshots.of_cache(rid, key, cache)
            result.outputs.append(output)
            if chunk.is_last and self.batchable:
                self.joining.append(rid)
        except Exception as e:  # a failing step fails its request, not the engine
            logger.exception("prefill failed for request %s", rid)
            self._prefill_failed(rid, e, result)

    def _prefill_failed(self, request_id: str, error: Exception, result: StepResult) -> None:
        self._forget([request_id])
        result.outputs.append(RequestOutput(request_id, error=_describe(error)))

    def _feed_only(self, logits: mx.array, cache: list[Any]) -> None:
        """Evaluate what a chunk wrote into the cache, not its logits: nothing samples
        from a chunk that does not end the prompt, so there the head never runs."""
        mx.eval(cache_arrays(cache) or [logits])

    # -- decode -------------------------------------------------------------
    def _decode_mode(self, plan: StepPlan) -> DecodeMode:
        """AHEAD only when the next step's rows are known now: no prefill in this step
        (its requests would join next step) and no drafts. A row that finishes
        leaves the batch with its token drawn ahead unread; its `prompt + output`
        snapshot is trimmed back to what it has output. OVERLAP when prefill
        chunks run beside the decode and every row samples without the host
        knowing its tokens first."""
        if not (self.decode_ahead and self.batchable) or plan.drafts:
            return DecodeMode.PLAIN
        if not plan.prefills:
            return DecodeMode.PLAIN if self.joining else DecodeMode.AHEAD
        return DecodeMode.OVERLAP if self._pipelinable(plan.decodes) else DecodeMode.PLAIN

    def _pipelinable(self, requests: list[Request]) -> bool:
        return all(pipelinable(r.params, self.samplers[r.request_id]) for r in requests)

    def _decode(self, plan: StepPlan, result: StepResult) -> DecodeTokens:
        """Decode every running row (rows with drafts verify them instead, when their
        cache can be cut back and no step ran ahead of them)."""
        finish, drafts = plan.finish_rule, plan.drafts
        if not self.batchable:
            for request in plan.decodes:
                cache = self.caches[request.request_id]
                if self.verify.applies([request], drafts, 1):
                    self._verify([request], [drafts[request.request_id]], cache, finish, result)
                else:
                    self._decode_rows([request], cache, finish, result, DecodeMode.PLAIN)
            return DecodeTokens()
        by_id = {r.request_id: r for r in plan.decodes}
        ordered = [by_id[rid] for rid in self.batch.request_ids if rid in by_id]
        cache = self.batch.cache
        if self.batch.ahead is None and self.verify.applies(ordered, drafts, len(ordered)):
            self._verify(ordered, [drafts[r.request_id] for r in ordered], cache, finish, result)
            return DecodeTokens()
        return self._decode_rows(ordered, cache, finish, result, self._decode_mode(plan))

    def _verify(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        cache: list[Any],
        finish: FinishRule | None,
        result: StepResult,
    ) -> None:
        try:
            states = [self.samplers[r.request_id] for r in requests]
            kept = self.verify.run(requests, drafts, cache, states)
        except Exception as e:  # a failing step fails its requests, not the engine
            logger.exception("verify step failed for %d request(s)", len(requests))
            self._decode_failed(requests, e, result)
            return
        for request, tokens, row_drafts in zip(requests, kept, drafts, strict=True):
            output = RequestOutput(request.request_id, sampled=tokens[0], accepted=tokens[1:])
            output.drafted = len(row_drafts)
            output.snapshot = self._finishing_snapshot(request, tokens, finish)
            result.outputs.append(output)

    def _decode_rows(
        self,
        requests: list[Request],
        cache: list[Any],
        finish: FinishRule | None,
        result: StepResult,
        mode: DecodeMode,
    ) -> DecodeTokens:
        """One decode step over `cache`. AHEAD starts the next step before this one's
        tokens are read, so building its graph overlaps this step's compute (the
        way mlx-lm's and mlx-vlm's own loops decode). OVERLAP starts the forward
        and returns what reads its tokens, to be called once the step's other
        graphs are built."""
        try:
            started = time.perf_counter()
            request_ids = [r.request_id for r in requests]
            if self.batchable and len(requests) != len(self.batch.request_ids):
                raise RuntimeError("decode batch out of step with the scheduler")
            self._check(faults.FORWARD, request_ids)
            drawing = self._draw_started_earlier(requests)
            if drawing is None and mode is DecodeMode.PLAIN:
                rows = self._sample(self._forward(requests, cache), requests)
            else:
                if drawing is None:
                    drawing = self._draw(self._forward(requests, cache), requests)
                    drawing.start()
                if mode is DecodeMode.OVERLAP:
                    spent, drawn = time.perf_counter() - started, drawing
                    return DecodeTokens(
                        lambda: self._settle(requests, drawn, finish, result, spent)
                    )
                if mode is DecodeMode.AHEAD:
                    self.batch.ahead = self._step_ahead(drawing, requests, cache)
                rows = self._take(drawing, requests)
                self._draw_in_flight(requests)
            result.decode_s += time.perf_counter() - started
        except Exception as e:  # a failing step fails its requests, not the engine
            logger.exception("decode step failed for %d request(s)", len(requests))
            self._decode_failed(requests, e, result)
            return DecodeTokens()
        self._decoded(requests, rows, finish, result)
        return DecodeTokens()

    def _forward(self, requests: list[Request], cache: list[Any]) -> mx.array:
        inputs = mx.array([[r.output_ids[-1]] for r in requests], dtype=mx.int32)
        return self.tap.last_logits(inputs, cache, decode_positions(requests))

    def _draw_started_earlier(self, requests: list[Request]) -> PendingSample | None:
        """The draw of the step a previous step started ahead, if any (its logits are
        drawn from now, where that step could not draw before these tokens were read:
        the masks and penalties know them)."""
        ahead = self.batch.take_ahead([r.request_id for r in requests]) if self.batchable else None
        if isinstance(ahead, PendingLogits):
            return self._draw(ahead.logits, requests)
        return ahead

    def _settle(
        self,
        requests: list[Request],
        pending: PendingSample,
        finish: FinishRule | None,
        result: StepResult,
        spent: float,
    ) -> None:
        """Read a decode step started earlier in this run; `spent`: its time so far."""
        try:
            started = time.perf_counter()
            rows = self._take(pending, requests)
            result.decode_s += spent + time.perf_counter() - started
        except Exception as e:  # a failing step fails its requests, not the engine
            logger.exception("decode step failed for %d request(s)", len(requests))
            self._decode_failed(requests, e, result)
            return
        self._decoded(requests, rows, finish, result)

    def _decode_failed(self, requests: list[Request], error: Exception, result: StepResult) -> None:
        self._forget([r.request_id for r in requests])
        for request in requests:
            result.outputs.append(RequestOutput(request.request_id, error=_describe(error)))

    def _decoded(
        self,
        requests: list[Request],
        rows: list[SampledRow],
        finish: FinishRule | None,
        result: StepResult,
    ) -> None:
        result.decode_tokens += len(requests)
        for request, row in zip(requests, rows, strict=True):
            output = RequestOutput(request.request_id, sampled=row)
            output.snapshot = self._finishing_snapshot(request, [row], finish)
            result.outputs.append(output)

    def _forget(self, request_ids: list[str]) -> None:
        """After an error (an allocation failure among them): drop the caches, free memory."""
        try:
            self.release(request_ids)
        finally:
            mx.clear_cache()

    def _draw(self, logits: mx.array, requests: list[Request]) -> PendingSample:
        states = [self.samplers[r.request_id] for r in requests]
        return sample_lazy(logits, [r.params for r in requests], states)

    def _step_ahead(
        self, pending: PendingSample, requests: list[Request], cache: list[Any]
    ) -> PendingSample | PendingLogits:
        """Feed the tokens being drawn as the next step's inputs and start that step:
        its draw too where no row's sampling needs the tokens read first."""
        inputs = pending.tokens.astype(mx.int32)[:, None]
        logits = self.tap.last_logits(inputs, cache, decode_positions(requests, ahead=1))
        following: PendingSample | PendingLogits
        if self._pipelinable(requests):
            following = self._draw(logits, requests)
        else:
            following = PendingLogits(logits)
        following.start()
        return following

    def _draw_in_flight(self, requests: list[Request]) -> None:
        """The step in flight draws once this step's tokens are recorded: start its draw
        now, so it computes while the engine emits and plans (rows that end here draw
        a token nobody reads; a complete grammar allows only end-of-sequence)."""
        ahead = self.batch.ahead
        if isinstance(ahead, PendingLogits):
            drawn = self._draw(ahead.logits, requests)
            drawn.start()
            self.batch.ahead = drawn

    def _take(self, pending: PendingSample, requests: list[Request]) -> list[SampledRow]:
        self._check(faults.SAMPLE, [r.request_id for r in requests])
        return self._record(requests, pending.take())

    def _record(self, requests: list[Request], rows: list[SampledRow]) -> list[SampledRow]:
        for request, row in zip(requests, rows, strict=True):
            record_token(self.samplers[request.request_id], request.params, row.token)
        return rows

    def _finishing_snapshot(
        self, request: Request, tokens: list[SampledRow], finish: FinishRule | None
    ) -> Snapshot | None:
        if finish is None or not self.completion_snapshots:
            return None
        return self.snapshots.of_ending_row(self.batch, request, tokens, finish)

    def _check(self, phase: str, request_ids: list[str]) -> None:
        if self.fault is not None:
            self.fault(phase, request_ids)

    def _sample(
        self, logits: mx.array, requests: list[Request], check: bool = True
    ) -> list[SampledRow]:
        if check:
            self._check(faults.SAMPLE, [r.request_id for r in requests])
        states = [self.samplers[r.request_id] for r in requests]
        params = [r.params for r in requests]
        return self._record(requests, sample_rows(logits, params, states))
