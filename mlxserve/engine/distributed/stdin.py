"""A rank's stdin, which it never reads, let go of as early as the rank can.

mlx.launch (mlx 0.32) forwards its own input to each rank with a thread that waits
in `select` on the rank's stdin pipe as writable, which a pipe always is: that
thread spins for as long as the pipe is open. Once the rank's end is closed, the
first byte mlx.launch forwards breaks the pipe and the thread stops polling it
(`mlxserve.bench.launcher.start_launch` writes such bytes; on a terminal, Enter does).
Kept free of heavy imports: `mlxserve serve --distributed` calls it before it
imports MLX, so the launcher spins through none of the rank's start-up.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("mlxserve.distributed")


def let_go_of_stdin() -> None:
    """Read stdin from /dev/null from now on (the pipe mlx.launch gave is closed)."""
    try:
        null = os.open(os.devnull, os.O_RDONLY)
    except OSError as e:
        logger.warning("stdin stays as it is (%s): mlx.launch may keep polling it", e)
        return
    os.dup2(null, 0)
    os.close(null)
