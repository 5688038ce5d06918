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
from mlxserve.engine.plan import Snapshot

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
