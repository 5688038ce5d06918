"""Prefix-cache snapshots the runner takes: of a request's own cache or of a batch row.

A snapshot that fails costs only its prefix-cache entry, never the request,
so every failure here is logged and answered with None. A model whose caches
cannot be copied turns snapshots off once.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from mlxserve.engine import faults
from mlxserve.engine.decode_batch import DecodeBatch
from mlxserve.engine.faults import FaultHook
from mlxserve.engine.plan import FinishRule, Snapshot
from mlxserve.engine.request import Request
from mlxserve.engine.sampling import SampledRow

logger = logging.getLogger(__name__)


class SnapshotTaker:
    def __init__(self, fault: FaultHook | None = None) -> None:
        self.fault = fault
        self.supported = True

    def of_cache(self, request_id: str, key_ids: list[int], cache: list[Any]) -> Snapshot | None:
        """A copy of a request's own cache, which holds exactly `key_ids`."""
        try:
            return self._copy(key_ids, cache, request_id)
        except Exception:  # the answer stands; only this prefix-cache entry is lost
            logger.exception("snapshot of request %s failed", request_id)
            return None

    def of_row(self, batch: DecodeBatch, request_id: str, key_ids: list[int]) -> Snapshot | None:
        """A copy of one decode-batch row, cut back to `key_ids` if it holds more."""
        try:
            row = batch.request_ids.index(request_id)
            extracted = [layer.extract(row) for layer in batch.cache]
            excess = extracted[0].offset - len(key_ids)
            if excess > 0:  # a step that ran ahead (or verified drafts) fed past the key
                trim_prompt_cache(extracted, excess)
            return self._copy(key_ids, extracted, request_id)
        except Exception:  # the request is finishing; only its prefix-cache entry is lost
            logger.exception("snapshot of finished request %s failed", request_id)
            mx.clear_cache()
            return None

    def of_completed(
        self,
        completed: list[tuple[str, list[int]]],
        batch: DecodeBatch,
        caches: dict[str, list[Any]],
    ) -> list[tuple[str, Snapshot]]:
        """`prompt + output` snapshots of finished requests (for trimmable, batched KV
        caches only: a later prompt that re-renders the reply differently could not
        reuse an entry it cannot trim)."""
        taken = []
        for request_id, key_ids in completed:
            if request_id in batch.request_ids:
                snapshot = self.of_row(batch, request_id, key_ids)
            elif request_id in caches:  # it had not joined the batch yet
                snapshot = self.of_cache(request_id, key_ids, caches[request_id])
            else:
                continue
            if snapshot is not None:
                taken.append((request_id, snapshot))
        return taken

    def of_ending_row(
        self, batch: DecodeBatch, request: Request, tokens: list[SampledRow], finish: FinishRule
    ) -> Snapshot | None:
        """The `prompt + output` snapshot of a decode row that one of `tokens` ends."""
        for earlier, row in enumerate(tokens):
            if finish.status(request, row.token, earlier) is not None:
                # The cache holds prompt + output; the ending token is never fed.
                key = request.prompt_ids + request.output_ids + [t.token for t in tokens[:earlier]]
                return self.of_row(batch, request.request_id, key)
        return None

    def _copy(self, key_ids: list[int], cache: list[Any], request_id: str) -> Snapshot | None:
        from mlxserve.cache.snapshot import UnsupportedCacheError, copy_cache

        if not self.supported:
            return None
        if self.fault is not None:
            self.fault(faults.SNAPSHOT, [request_id])
        try:
            # Scheduled, not waited for: the copy overlaps the next forward.
            return Snapshot(list(key_ids), copy_cache(cache, wait=False))
        except UnsupportedCacheError as e:
            logger.warning("prefix cache off for this model: %s", e)
            self.supported = False
            return None
