"""A blocking side channel beside the plan's collective: a follower sleeps until rank 0 sends.

MLX's ring backend busy-polls inside a collective, so a follower that waited for
the next plan in the collective itself burnt a core for as long as rank 0 was idle
or busy with its own work between steps. Instead, rank 0 listens on a TCP socket
(an ephemeral port on its own address, the one the launcher gave the ranks: the
ring's hostfile, or jaccl's coordinator) and every follower connects once at
startup. Before each plan's collective rank 0 writes one byte to every follower;
a follower blocks in `recv` (in the kernel, no CPU) until that byte comes, then
enters the collective, which rank 0 has already entered. Exactly one byte per
broadcast, so the two never drift apart.

A socket that closes or resets raises `OSError` (the group turns it into `PeerLost`:
a peer gone, as a failed collective is). Where the channel cannot be set up (no
address from the launcher, a bind or connect that fails, a rank that did not join)
every rank keeps waiting in the collective, as before, after one warning.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("mlxserve.distributed")

# How long the ranks give each other to connect at startup, and the longest a write
# of one byte may block (it cannot, unless a follower stopped reading: then it is lost).
CONNECT_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 10.0
# A follower's greeting: its rank and rank 0's nonce (a stranger's connection is refused).
_HELLO = struct.Struct("!iii")
_WAKE = b"\x01"

# The all-ranks sum of a list of ints (each rank passes its own; mx.distributed.all_sum).
Total = Callable[[list[int]], list[int]]


def rank0_address(environ: dict[str, str] | None = None) -> str | None:
    """Rank 0's IP as the launcher named it: the first entry of the ring's hostfile
    (`MLX_HOSTFILE`, a JSON list of each rank's "ip:port" list), or jaccl's coordinator
    (`MLX_JACCL_COORDINATOR`, "ip:port"); None when neither says."""
    env = os.environ if environ is None else environ
    coordinator = env.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return _host(coordinator)
    hostfile = env.get("MLX_HOSTFILE")
    if not hostfile:
        return None
    try:
        hosts = json.loads(Path(hostfile).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(hosts, list) or not hosts:
        return None
    first = hosts[0]
    if isinstance(first, list):
        first = first[0] if first else None
    return _host(first) if isinstance(first, str) else None


def _host(address: str) -> str | None:
    host = address.rsplit(":", 1)[0].strip()
    if host.startswith("[") and host.endswith("]"):  # an IPv6 "[addr]:port"
        host = host[1:-1]
    return host or None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class PlanWakeup:
    """One end of the channel: rank 0's sockets to every follower, or a follower's to rank 0."""

    def __init__(self, rank: int, sockets: list[socket.socket]) -> None:
        self.rank = rank
        self.sockets = sockets

    def notify(self) -> None:
        """Rank 0: a plan's collective follows; wake every follower. OSError (a reset,
        a broken pipe, a follower that stopped reading for `SEND_TIMEOUT_S`): one is gone."""
        for sock in self.sockets:
            sock.sendall(_WAKE)

    def wait(self) -> None:
        """A follower: sleep until rank 0 is about to send a plan. OSError if rank 0 is gone
        (ConnectionError for a closed socket). No timeout: the follower's watchdog thread
        ends a wait that lasts too long."""
        if not self.sockets[0].recv(1):
            raise ConnectionError("rank 0 closed the plan channel")

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets = []


def open_wakeup(rank: int, size: int, total: Total, host: str | None) -> PlanWakeup | None:
    """Set the channel up between `size` ranks, rank 0 listening on `host` (its address
    as the launcher named it, `rank0_address()`). Every rank calls it and runs the same
    two collectives (`total`). None, after a warning, where it cannot be set up: the
    plans then wait in the collective as before."""
    listener: socket.socket | None = None
    offer = [0, 0, 0]
    why = "the launcher names no address for rank 0"
    if rank == 0 and host is not None:
        try:
            listener = socket.create_server((host, 0), family=_family(host), backlog=size)
            offer = [listener.getsockname()[1], secrets.randbits(31), secrets.randbits(31)]
        except OSError as e:
            why = f"cannot listen on {host}: {e}"
    port, *nonce = total(offer)
    sockets: list[socket.socket] = []
    if port and host is not None:
        why = "a rank could not connect to rank 0's port"
        if rank == 0:
            assert listener is not None
            sockets = _accept(listener, size, (nonce[0], nonce[1]))
        else:
            sockets = _connect(rank, host, port, (nonce[0], nonce[1]))
    if listener is not None:
        listener.close()
    ready = len(sockets) == (size - 1 if rank == 0 else 1)
    if total([int(ready)])[0] == size:
        logger.info("rank %d: followers wait for plans on a socket to rank 0", rank)
        return PlanWakeup(rank, sockets)
    for sock in sockets:
        sock.close()
    if rank == 0:  # one warning, where the reason is known
        logger.warning(
            "no plan wake-up channel (%s): followers wait for plans inside the "
            "collective, which busy-polls a core",
            why,
        )
    return None


def _accept(listener: socket.socket, size: int, nonce: tuple[int, int]) -> list[socket.socket]:
    """Rank 0: one socket per follower, in rank order ([] if any is missing)."""
    found: dict[int, socket.socket] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while len(found) < size - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except OSError as e:  # includes the timeout
            logger.warning("rank 0: waiting for the followers' plan channels: %s", e)
            break
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            hello = _recv_exactly(sock, _HELLO.size)
            peer, *sent = _HELLO.unpack(hello)
        except OSError:
            sock.close()
            continue
        if tuple(sent) != nonce or not 0 < peer < size or peer in found:
            sock.close()  # not one of our followers
            continue
        sock.settimeout(SEND_TIMEOUT_S)
        # One byte per plan: sent at once, never held back waiting for an ack (Nagle).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        found[peer] = sock
    if len(found) < size - 1:
        for sock in found.values():
            sock.close()
        return []
    return [found[r] for r in range(1, size)]


def _connect(rank: int, host: str, port: int, nonce: tuple[int, int]) -> list[socket.socket]:
    """A follower: its socket to rank 0, greeted ([] if that failed)."""
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        logger.warning("rank %d: cannot reach rank 0's plan channel: %s", rank, e)
        return []
    try:
        sock.sendall(_HELLO.pack(rank, *nonce))
    except OSError as e:
        logger.warning("rank %d: cannot greet rank 0's plan channel: %s", rank, e)
        sock.close()
        return []
    sock.settimeout(None)  # a wait blocks until rank 0 writes (the watchdog bounds it)
    return [sock]


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("closed before its greeting")
        data += chunk
    return data
