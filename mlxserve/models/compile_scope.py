"""Compiled kernels only for input shapes that repeat.

`mx.compile` keeps one entry per distinct input shape for the life of the
compiled function (the traced graph, and on Metal its generated kernels), and
never evicts one. Model code calls compiled helpers with the forward's shape:
mlx-vlm's DeepSeek-V4 (`_limited_swiglu`, the hyper-connection and
compressor ops, expert selection) and mlx-lm families such as DeepSeek-V3
compile without `shapeless`. A server sees a new prefill length at almost every
turn, so each turn left about 100 KB of native memory behind for good (measured
on the tiny DeepSeek-V4: 40 distinct prefill lengths, +3.9 MB of malloc'd bytes
outside MLX's own accounting; with compilation off for them, +0.01 MB).

Decode and verify forwards have a bounded set of shapes (rows <= max_num_seqs,
positions <= 1 + drafts), so they keep their compiled kernels, where fusion
pays most. A forward over more positions than `MAX_COMPILED_POSITIONS` (a
prefill chunk) runs its compiled helpers as plain operations: the same
primitives, evaluated without fusion, which prefill's large matmuls dwarf.

`mx.disable_compile` is process-wide, and several engines (one owner thread
per served model) may run forwards at once: a depth counter under a lock keeps
compilation off while any thread is inside an uncompiled forward. A decode of
another engine that overlaps it runs unfused, never wrongly. A process started
with `MLX_DISABLE_COMPILE` set is left uncompiled throughout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from mlxserve.config import MAX_DRAFT_TOKENS

# A verify forward feeds each row its last token and its drafts.
MAX_COMPILED_POSITIONS = 1 + MAX_DRAFT_TOKENS

_lock = threading.Lock()
_depth = 0
_disabled_by_environment = bool(os.environ.get("MLX_DISABLE_COMPILE"))


@contextmanager
def uncompiled_unless_bounded(positions: int) -> Iterator[None]:
    """Run the body with compilation off when `positions` is a prefill's length."""
    if positions <= MAX_COMPILED_POSITIONS:
        yield
        return
    global _depth
    with _lock:
        if _depth == 0:
            mx.disable_compile()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and not _disabled_by_environment:
                mx.enable_compile()
