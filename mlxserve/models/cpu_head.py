"""A float32 lm_head on the CPU backend: stored column-major, computed in parts at once.

A tiny model's decode step is mostly its 129k-row head, and on the CPU backend
that head runs on the wheel's reference BLAS, one thread:

- nn.Linear computes `x @ weight.T`. With the weight stored row-major, BLAS
  gets a transposed operand and runs one scalar dot product per output. With
  the weight's transpose stored contiguous, the same sums (same order: bit-equal
  logits) run as vectorised column updates, about 1.5x faster.
- Split by vocabulary rows into parts, each part's product runs on its own CPU
  stream, so on its own thread: with two cores a head of 4 or 8 rows takes
  about 0.6 of its time (measured on the tiny checkpoints' 129280 x 64 head).

Each output is still the one BLAS sum over the hidden size, so the logits are
bit-equal to `nn.Linear`'s. Half-precision heads gain nothing from the layout
and biased ones would not be bit-equal (BLAS adds the bias first): both stay
as they are, as do quantized heads and any head on the GPU.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# More parts than this gain little while the rest of a step runs on one thread.
MAX_PARTS = 4
# Fewer rows run their parts on one stream: on the tiny DeepSeek-V4 one row split
# over two streams decoded slower (130 against 148 tokens/s), the next step's
# graph building then competing for the second core.
MIN_SPLIT_ROWS = 2
# Part boundaries fall on multiples of this many rows (whole vector lanes).
_ROW_ALIGN = 64


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


class SplitHead(nn.Module):
    """`x @ weight.T` over parts of the vocabulary, each on its own CPU stream."""

    def __init__(self, weight: mx.array, parts: int) -> None:
        super().__init__()
        rows = weight.shape[0]
        step = -(-rows // max(1, parts))
        step = -(-step // _ROW_ALIGN) * _ROW_ALIGN
        # Each part holds the transpose of a block of rows: (hidden, rows in the block).
        self.parts = [mx.contiguous(weight[a : a + step].T) for a in range(0, rows, step)]
        mx.eval(self.parts)
        # Streams belong to the thread that made them (MLX's rule): one set per thread.
        self._threads = threading.local()

    def _streams(self) -> list[Any]:
        streams = getattr(self._threads, "streams", None)
        if streams is None:
            streams = [mx.default_stream(mx.cpu)]
            streams += [mx.new_stream(mx.cpu) for _ in self.parts[1:]]
            self._threads.streams = streams
        return streams

    def __call__(self, x: mx.array) -> mx.array:
        if len(self.parts) == 1:
            return x @ self.parts[0]
        if x.size // x.shape[-1] < MIN_SPLIT_ROWS:
            return mx.concatenate([x @ part for part in self.parts], axis=-1)
        outputs = [
            mx.matmul(x, part, stream=s)
            for part, s in zip(self.parts, self._streams(), strict=True)
        ]
        return mx.concatenate(outputs, axis=-1)


def install(module: Any, parts: int | None = None) -> bool:
    """Replace `module.lm_head` by a SplitHead where that gives the same logits
    faster (see the module doc); True if it did. `parts`: default one per core."""
    lm_head = getattr(module, "lm_head", None)
    if (
        mx.default_device() != mx.cpu
        or type(lm_head) is not nn.Linear
        or "bias" in lm_head
        or lm_head.weight.dtype != mx.float32
    ):
        return False
    count = parts if parts is not None else min(MAX_PARTS, available_cores())
    module.lm_head = SplitHead(lm_head.weight, count)
    return True
