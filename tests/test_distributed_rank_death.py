"""A rank that dies ends the whole launch within 10 s, even on a saturated machine.

Two CPU-bound processes run beside `mlx.launch --backend ring -n 2` (each rank
pinned to a core of its own, so every core is shared with a burner). With two
streams open, one rank is killed: both streams fail and every rank and
`mlx.launch` itself are gone within `EXIT_WITHIN_S` of the kill. Rank 0 must
not wait out a collective, uvicorn's graceful shutdown or the engine thread's
join when its peer is gone; a follower must not wait for a plan that never
comes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dist_helpers import LaunchedServer, kill_rank_and_watch_exit, launch_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(not launch_available(), reason="mlx.launch is not installed"),
]

BURNERS = 2


@pytest.fixture
def saturated() -> Iterator[None]:
    """Two busy loops, one per core of this machine, for the test's duration."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BURNERS)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(timeout=30)


@pytest.mark.parametrize("victim", [1, 0])
def test_every_rank_exits_soon_after_one_dies_under_load(
    victim: int,
    model_dir_factory: Callable[..., Path],
    saturated: None,
    tmp_path: Path,
) -> None:
    path = model_dir_factory("llama")
    with LaunchedServer(path, "tensor", log=tmp_path / "launch.log") as server:
        kill_rank_and_watch_exit(server, victim)
