"""The verify step: one forward over each row's last token and its drafts.

The runner holds one `VerifyStep` and calls it for a decode step whose rows
carry drafts. The rows keep what their samplers agree with (`verify.py`) and
their caches are cut back past the rest (`rollback.py`); the runner turns
the kept tokens into outputs as it does a plain step's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxserve.engine import faults
from mlxserve.engine.faults import FaultHook
from mlxserve.engine.request import Request
from mlxserve.engine.sampling import SampledRow, SamplerState
from mlxserve.engine.spec.mtp_drafter import HiddenTap, decode_positions
from mlxserve.engine.spec.rollback import CutBack, verify_rows_limit
from mlxserve.engine.spec.verify import verify_rows
from mlxserve.models.loaded import LoadedModel


class VerifyStep:
    def __init__(
        self,
        model: LoadedModel,
        tap: HiddenTap,
        probe: list[Any],
        batchable: bool,
        fault: FaultHook | None = None,
    ) -> None:
        self.model = model
        self.tap = tap
        self.fault = fault
        self.batchable = batchable
        # How many rows may verify drafts together (`rollback.py`; 0: none, None: any).
        self.rows_limit = verify_rows_limit(probe, batchable)

    def applies(self, requests: list[Request], drafts: dict[str, list[int]], rows: int) -> bool:
        """Whether these rows verify drafts this step: every row has drafts, their
        caches can be cut back that many rows at once, and, where requests decode
        batched, they are the whole batch of `rows`."""
        if not requests or not all(drafts.get(r.request_id) for r in requests):
            return False
        if self.rows_limit is not None and len(requests) > self.rows_limit:
            return False
        return not self.batchable or len(requests) == rows

    def run(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        cache: list[Any],
        states: list[SamplerState],
    ) -> list[list[SampledRow]]:
        """Each row's kept tokens (the sampled one first, then the drafts it accepted).
        Raises what the forward or the sampler raised; the caller fails the rows."""
        request_ids = [r.request_id for r in requests]
        self._check(faults.FORWARD, request_ids)
        rows = [[r.output_ids[-1], *d] for r, d in zip(requests, drafts, strict=True)]
        inputs = mx.array(rows, dtype=mx.int32)
        cut = CutBack(cache, inputs, self.model.model.last_logits)
        logits, sink = self.tap.logits(inputs, cut.cache)
        self._check(faults.SAMPLE, request_ids)
        kept = verify_rows(logits, requests, drafts, states)
        # The cache holds every fed position; the last kept token is fed next step.
        cut.keep(len(kept[0]), len(requests))
        self.tap.keep(sink, decode_positions(requests), len(kept[0]))
        return kept

    def _check(self, phase: str, request_ids: list[str]) -> None:
        if self.fault is not None:
            self.fault(phase, request_ids)
