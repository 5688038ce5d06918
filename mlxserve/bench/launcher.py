"""Servers and `mlx.launch` runs a bench (or a test) starts on this machine's loopback.

Free ports: a port found free by binding port 0 comes from the kernel's ephemeral range, the
range every outgoing connection also takes its local port from. Between the check
and the server's own bind (an interpreter's start, seconds), any client on the
machine may take it: an `mlx.launch` ring whose port was taken so failed all four
of its join attempts while other servers answered requests beside it. Ports below
the ephemeral range are never handed out that way, so only another caller of this
function could take them, and it draws at random from thousands.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Linux's default ephemeral range starts at 32768 (macOS's at 49152); the range this
# machine uses is read where it can be.
_DEFAULT_EPHEMERAL_START = 32768
_LOWEST = 10000
_TRIES = 200


def _ephemeral_start() -> int:
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START
    return first


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_loopback_ports(count: int = 1) -> int:
    """A port P of 127.0.0.1 with P .. P + count - 1 all free, below the ephemeral range
    (the ring backend's ranks listen on P, P + 1, ...)."""
    top = _ephemeral_start() - count
    if top <= _LOWEST:  # a machine whose ephemeral range covers nearly every port
        top = 65536 - count
    draw = random.SystemRandom()
    for _ in range(_TRIES):
        port = draw.randrange(_LOWEST, top)
        if all(_bindable(port + i) for i in range(count)):
            return port
    raise RuntimeError(f"no {count} free loopback ports in a row after {_TRIES} draws")


def mlx_launch_path() -> str:
    """The `mlx.launch` command: on PATH, or beside this interpreter (a venv not activated)."""
    return shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))


def loopback_launch(*command: str) -> list[str]:
    """`mlx.launch` running `command` as two ranks of this machine (ring, 127.0.0.1 only)."""
    ring = ["--backend", "ring", "-n", "2", "--hosts", "127.0.0.1"]
    ports = ["--starting-port", str(free_loopback_ports(2))]
    return [mlx_launch_path(), *ring, *ports, "--", *command]


# How often `start_launch` hands mlx.launch a byte to forward.
_NUDGE_EVERY_S = 0.25


def start_launch(argv: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start `mlx.launch` (argv from `loopback_launch`) without its busy loops.

    mlx.launch (mlx 0.32) forwards its own input to each rank with a thread that
    waits in `select` on the rank's stdin pipe as writable, which a pipe always is:
    each thread spins while its rank lives, and its main loop spins too when its own
    input is at end of file (/dev/null). Together about 1.2 cores for the launch's
    whole life. So mlx.launch reads a pipe kept open here, and a newline four times a
    second: a rank that has let go of its stdin (`serve --distributed` does before it
    imports MLX, `engine/distributed/stdin.py`) breaks its pipe, and the next byte
    forwarded to it ends that thread's polling."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, **popen)
    feed = proc.stdin
    assert feed is not None

    def nudge() -> None:
        try:
            while proc.poll() is None:
                feed.write(b"\n")
                feed.flush()
                time.sleep(_NUDGE_EVERY_S)
        except (BrokenPipeError, ValueError):
            pass  # mlx.launch is gone (or exiting): nothing left to forward to
        finally:
            with contextlib.suppress(BrokenPipeError):  # its last bytes had nowhere to go
                feed.close()

    threading.Thread(target=nudge, name="mlx.launch input", daemon=True).start()
    return proc
