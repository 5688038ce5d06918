"""How far a model load has got: written by the loading thread, read by /health and the logs.

`load()` builds the module with lazy weights (mlx-lm's and mlx-vlm's public
`load_model(..., lazy=True)`), then evaluates the parameters itself in
slices, so the fraction is the share of weight bytes read and materialised;
building the module and loading the tokenizer are short stages around it.
On a terminal the load draws a progress bar (tqdm); elsewhere the server's
loading reporter logs the fraction every few seconds.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

# Where each stage starts; "weights" runs from its start to the next stage's.
STAGES = {"starting": 0.0, "module": 0.02, "weights": 0.05, "tokenizer": 0.95, "ready": 1.0}


class LoadProgress:
    """The fraction (0..1) and stage of one model load; safe to read from any thread."""

    def __init__(self, bar: bool | None = None) -> None:
        self._lock = threading.Lock()
        self._fraction = 0.0
        self._stage = "starting"
        self._bar_wanted = sys.stderr.isatty() if bar is None else bar
        self._bar: Any = None

    @property
    def fraction(self) -> float:
        with self._lock:
            return self._fraction

    @property
    def stage(self) -> str:
        with self._lock:
            return self._stage

    def enter(self, stage: str) -> None:
        """Start a stage (see STAGES); the fraction jumps to where it begins."""
        self._set(STAGES[stage], stage)

    def weights(self, done_bytes: int, total_bytes: int) -> None:
        """Within the weights stage: `done_bytes` of `total_bytes` materialised."""
        start, end = STAGES["weights"], STAGES["tokenizer"]
        share = done_bytes / total_bytes if total_bytes > 0 else 1.0
        self._set(start + (end - start) * min(1.0, share), "weights")

    def _set(self, fraction: float, stage: str) -> None:
        with self._lock:
            self._fraction = max(self._fraction, min(1.0, fraction))
            self._stage = stage
            value = self._fraction
        self._draw(value, stage)

    def _draw(self, fraction: float, stage: str) -> None:
        if not self._bar_wanted:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=100, desc="loading", unit="%", leave=True, file=sys.stderr)
        self._bar.set_postfix_str(stage, refresh=False)
        self._bar.update(round(fraction * 100) - self._bar.n)
        if fraction >= 1.0:
            self._bar.close()
