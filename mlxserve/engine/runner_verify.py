"""The runner's verify path: a decode step whose rows carry draft tokens.

One forward feeds each row its last token and its drafts; the rows keep what
their samplers agree with (`verify.py`) and their caches are cut back past
the rest (`rollback.py`). A row that one of its kept tokens ends gets its
`prompt + output` snapshot here, as a plain decode step's would.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from mlxserve.engine import faults
from mlxserve.engine.decode_batch import DecodeBatch
from mlxserve.engine.faults import FaultHook
from mlxserve.engine.mtp_drafter import HiddenTap, decode_positions
from mlxserve.engine.plan import FinishRule, RequestOutput, Snapshot, StepResult
from mlxserve.engine.request import Request
from mlxserve.engine.rollback import CutBack
from mlxserve.engine.sampling import SampledRow, SamplerState
from mlxserve.engine.snapshots import SnapshotTaker
from mlxserve.engine.verify import verify_rows
from mlxserve.models.loaded import LoadedModel

logger = logging.getLogger(__name__)


class VerifySteps:
    """What `Runner` verifies drafts with (it sets these attributes)."""

    model: LoadedModel
    fault: FaultHook | None
    batchable: bool
    completion_snapshots: bool
    verify_rows_limit: int | None
    batch: DecodeBatch
    samplers: dict[str, SamplerState]
    snapshots: SnapshotTaker
    tap: HiddenTap

    def _check(self, phase: str, request_ids: list[str]) -> None:
        if self.fault is not None:
            self.fault(phase, request_ids)

    def _decode_failed(self, requests: list[Request], error: Exception, result: StepResult) -> None:
        raise NotImplementedError

    def _verifiable(self, requests: list[Request], drafts: dict[str, list[int]]) -> bool:
        if not requests or not all(drafts.get(r.request_id) for r in requests):
            return False
        limit = self.verify_rows_limit
        if limit is not None and len(requests) > limit:
            return False
        return not self.batchable or len(requests) == len(self.batch.request_ids)

    def _verify(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        cache: list[Any],
        finish: FinishRule | None,
        result: StepResult,
    ) -> None:
        """One forward over each row's last token and its drafts; keep what the sampler
        agrees with (`verify.py`) and cut the caches back past the rest."""
        try:
            request_ids = [r.request_id for r in requests]
            self._check(faults.FORWARD, request_ids)
            rows = [[r.output_ids[-1], *d] for r, d in zip(requests, drafts, strict=True)]
            inputs = mx.array(rows, dtype=mx.int32)
            cut = CutBack(cache, inputs, self.model.model.last_logits)
            logits, sink = self.tap.logits(inputs, cut.cache)
            self._check(faults.SAMPLE, request_ids)
            states = [self.samplers[rid] for rid in request_ids]
            kept = verify_rows(logits, requests, drafts, states)
            # The cache holds every fed position; the last kept token is fed next step.
            cut.keep(len(kept[0]), len(requests))
            self.tap.keep(sink, decode_positions(requests), len(kept[0]))
        except Exception as e:  # a failing step fails its requests, not the engine
            logger.exception("verify step failed for %d request(s)", len(requests))
            self._decode_failed(requests, e, result)
            return
        for request, tokens, row_drafts in zip(requests, kept, drafts, strict=True):
            output = RequestOutput(request.request_id, sampled=tokens[0], accepted=tokens[1:])
            output.drafted = len(row_drafts)
            output.snapshot = self._finishing_snapshot(request, tokens, finish)
            result.outputs.append(output)

    def _finishing_snapshot(
        self, request: Request, tokens: list[SampledRow], finish: FinishRule | None
    ) -> Snapshot | None:
        """The `prompt + output` snapshot of a decode row that one of `tokens` ends."""
        if finish is None or not self.completion_snapshots:
            return None
        for earlier, row in enumerate(tokens):
            if finish.status(request, row.token, earlier) is not None:
                # The cache holds prompt + output; the ending token is never fed.
                key = request.prompt_ids + request.output_ids + [t.token for t in tokens[:earlier]]
                return self.snapshots.of_row(self.batch, request.request_id, key)
        return None
