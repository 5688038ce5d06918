"""Run a command pinned to one core of its own: the `MLX_RANK`-th of the allowed CPUs.

`mlx.launch` starts every rank of the distributed tests on this one machine. A rank
waiting on a collective busy-polls its socket (MLX's ring backend does), so ranks
sharing the cores take each other's compute time; one core each is what ranks on
machines of their own have. With fewer than two CPUs (or no affinity call, as on
macOS) the command runs as it is.

    python tests/pin_rank.py PROGRAM ARGS...
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    command = sys.argv[1:]
    if hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:
            rank = int(os.environ.get("MLX_RANK", "0"))
            os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
