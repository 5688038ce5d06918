"""`mlxserve.bench.launcher`: free ports below the kernel's ephemeral range, and
`mlx.launch` runs whose ranks let go of their stdin."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mlxserve.bench import launcher


def test_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    start = launcher._ephemeral_start()
    for count in (1, 2):
        port = launcher.free_loopback_ports(count)
        assert port >= launcher._LOWEST and port + count <= start
        for i in range(count):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + i))


def test_a_taken_port_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", launcher.free_loopback_ports()))
        taken.listen()
        busy = taken.getsockname()[1]
        # The first draws land on the taken port, or on the port just below it (whose
        # pair would run into it); the next draw is a free one.
        draws = iter([busy, busy - 1, busy - 1])

        class Draws(random.Random):
            def randrange(self, *args: object, **kw: object) -> int:  # type: ignore[override]
                return next(draws, busy + 7)

        monkeypatch.setattr(launcher.random, "SystemRandom", Draws)
        assert launcher.free_loopback_ports() == busy - 1
        assert launcher.free_loopback_ports(2) == busy + 7


RANK = """
import os, sys
from mlxserve.engine.distributed.stdin import let_go_of_stdin
let_go_of_stdin()
print("rank", os.environ["MLX_RANK"], "stdin", os.readlink("/proc/self/fd/0"), flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/fd/0").exists(), reason="needs /proc")
def test_a_launch_runs_with_its_ranks_off_their_stdin(tmp_path: Path) -> None:
    """`start_launch` keeps mlx.launch's input open and nudges it; each rank lets go of
    its stdin; the launch still ends on its own, with each rank's output."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    argv = launcher.loopback_launch(sys.executable, str(script))
    log = tmp_path / "launch.log"
    with log.open("wb") as sink:
        proc = launcher.start_launch(argv, stdout=sink, stderr=subprocess.STDOUT)
        assert proc.wait(timeout=120) == 0, log.read_text()
    out = log.read_text()
    lines = sorted(line for line in out.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} stdin /dev/null" for r in (0, 1)], out
