"""Image features for prefill chunks, on the owner thread (rule 1 of docs/architecture.md).

A request whose prompt holds images (`Request.images`) is prefilled like any
other, chunk by chunk; a chunk that covers image positions is fed input
embeddings instead of token ids: the token embeddings with the image's features
in its positions (`models/vision.py`). An image's features are computed once, by
the first chunk that reaches it, and kept until a chunk passes its end, so
a chunk boundary may fall anywhere inside an image's span: attention is causal and
each position's input is known up front, so the chunks compute what one forward
would. A prefix-cache hit that covers an image skips its features altogether.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxserve.engine.request import Request
from mlxserve.models.vision import PromptImage, VisionTower


@dataclass
class VisionCounters:
    """Images through the vision tower and the seconds it took (/metrics)."""

    images: int = 0
    seconds: float = 0.0


class VisionInputs:
    """The features of requests in prefill (see the module docstring)."""

    def __init__(self, tower: VisionTower | None) -> None:
        self.tower = tower
        self.counters = VisionCounters()
        self._features: dict[str, dict[int, mx.array]] = {}

    def embeddings(self, request: Request, start: int, end: int) -> mx.array | None:
        """Input embeddings of context positions [start, end), or None when they hold no
        image (the chunk is fed as token ids)."""
        touched = [
            (n, image)
            for n, image in enumerate(request.images)
            if image.start < end and image.end > start
        ]
        if not touched or self.tower is None:
            return None
        parts = []
        for n, image in touched:
            rows = self._of(request.request_id, n, image)
            first, last = max(image.start, start), min(image.end, end)
            parts.append((first, rows[first - image.start : last - image.start]))
            if image.end <= end:
                # No later chunk reads them: the scheduler's admission counts an image's
                # features only until its prefill passes it (`Request.feature_positions`).
                self._features[request.request_id].pop(n)
        return self.tower.embeddings(request.context_ids[start:end], start, parts)

    def model_ids(self, request: Request, start: int, end: int) -> list[int]:
        """The ids the language model reads at context positions [start, end): the
        context's, with each image's own ids (`PromptImage.model_ids`) in place of the
        content-keyed ones the prefix cache sees."""
        ids = list(request.context_ids[start:end])
        for image in request.images:
            if image.model_ids and image.start < end and image.end > start:
                first, last = max(image.start, start), min(image.end, end)
                ids[first - start : last - start] = image.model_ids[
                    first - image.start : last - image.start
                ]
        return ids

    def _of(self, request_id: str, n: int, image: PromptImage) -> mx.array:
        known = self._features.setdefault(request_id, {})
        if n not in known:
            assert self.tower is not None
            started = time.perf_counter()
            features = self.tower.features(image)
            # Evaluated here, so the tower's time is its own (not a later chunk's).
            mx.eval(features)
            self.counters.images += 1
            self.counters.seconds += time.perf_counter() - started
            known[n] = features
        return known[n]

    def forget(self, request_ids: Any) -> None:
        """Drop the features of these requests (prefill done, released or preempted)."""
        for request_id in request_ids:
            self._features.pop(request_id, None)

    def clear(self) -> None:
        self._features.clear()
