"""The plan's wake-up channel (`engine/distributed/wakeup.py`) without mlx.launch: the
ranks are threads of this process, their collective a sum over a barrier, and rank 0
listens on 127.0.0.1 only."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mlxserve.engine.distributed import wakeup as wakeup_module
from mlxserve.engine.distributed.group import PeerLost, PlanGroup
from mlxserve.engine.distributed.wakeup import PlanWakeup, open_wakeup, rank0_address

LOOPBACK = "127.0.0.1"


class ThreadRanks:
    """`size` ranks as threads: `total(rank)` is each one's all-ranks sum."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=30)
        self._lock = threading.Lock()
        self._parts: dict[int, list[int]] = {}
        self._result: list[int] = []

    def total(self, rank: int) -> Any:
        def run(values: list[int]) -> list[int]:
            with self._lock:
                self._parts[rank] = values
            if self._barrier.wait() == 0:
                self._result = [sum(col) for col in zip(*self._parts.values(), strict=True)]
            self._barrier.wait()
            result = list(self._result)
            self._barrier.wait()  # nobody starts the next sum before all have read this one
            return result

        return run


def _open_all(size: int, hosts: list[str | None]) -> list[PlanWakeup | None]:
    ranks = ThreadRanks(size)
    with ThreadPoolExecutor(size) as pool:
        futures = [
            pool.submit(open_wakeup, rank, size, ranks.total(rank), hosts[rank])
            for rank in range(size)
        ]
        return [f.result(timeout=60) for f in futures]


class _Ranks:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_rank_0s_address_comes_from_the_launcher(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.1:5000", "10.0.0.1:5001"], ["10.0.0.2:5002"]]))
    assert rank0_address({"MLX_HOSTFILE": str(hostfile)}) == "10.0.0.1"
    hostfile.write_text(json.dumps(["[fe80::1]:5000", "[fe80::2]:5000"]))
    assert rank0_address({"MLX_HOSTFILE": str(hostfile)}) == "fe80::1"
    assert rank0_address({"MLX_JACCL_COORDINATOR": "192.168.1.4:32323"}) == "192.168.1.4"
    hostfile.write_text("not json")
    assert rank0_address({"MLX_HOSTFILE": str(hostfile)}) is None
    assert rank0_address({"MLX_HOSTFILE": str(tmp_path / "missing.json")}) is None
    assert rank0_address({}) is None


def test_a_waiting_follower_sleeps_until_rank_0_notifies() -> None:
    rank0, *followers = _open_all(3, [LOOPBACK] * 3)
    assert rank0 is not None and all(f is not None for f in followers)
    cpu: list[float] = []
    woke: list[float] = []

    def wait(follower: PlanWakeup) -> None:
        started = time.thread_time()
        follower.wait()
        woke.append(time.monotonic())
        cpu.append(time.thread_time() - started)

    threads = [threading.Thread(target=wait, args=(f,)) for f in followers if f is not None]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    assert not woke  # still asleep: nothing was sent
    rank0.notify()
    for thread in threads:
        thread.join(timeout=10)
    assert len(woke) == 2
    # A second asleep in `recv` costs the waiting thread (next to) no CPU; a busy-poll
    # would have cost it the whole second.
    assert max(cpu) < 0.1
    # One byte per plan: a second notify wakes each follower exactly once more.
    rank0.notify()
    for follower in followers:
        assert follower is not None
        follower.wait()
    for end in (rank0, *followers):
        assert end is not None
        end.close()


def test_a_closed_channel_is_a_peer_lost() -> None:
    rank0, follower = _open_all(2, [LOOPBACK, LOOPBACK])
    assert rank0 is not None and follower is not None
    group = PlanGroup(_Ranks(1, 2))
    group.wakeup = follower
    rank0.close()  # rank 0's process is gone: the kernel closes its sockets
    with pytest.raises(PeerLost, match="closed the plan channel"):
        group.broadcast(None)
    follower.close()


def test_rank_0_sees_a_follower_gone() -> None:
    rank0, follower = _open_all(2, [LOOPBACK, LOOPBACK])
    assert rank0 is not None and follower is not None
    group = PlanGroup(_Ranks(0, 2))
    group.wakeup = rank0
    group.total = lambda values: list(values)  # type: ignore[method-assign]  # no collective
    follower.close()
    with pytest.raises(PeerLost, match="plan channel failed"):
        for _ in range(50):  # the first write may still succeed; the reset answers it
            group.broadcast([1, 2, 3])
            time.sleep(0.01)
    rank0.close()


def test_no_address_keeps_the_collective_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="mlxserve.distributed"):
        assert _open_all(2, [None, None]) == [None, None]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "names no address" in warnings[0].getMessage()


def test_a_follower_that_cannot_connect_leaves_every_rank_on_the_collective(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(wakeup_module, "CONNECT_TIMEOUT_S", 0.5)
    with caplog.at_level(logging.WARNING, logger="mlxserve.distributed"):
        # The follower is told no address: it never connects, and rank 0 gives up.
        assert _open_all(2, [LOOPBACK, None]) == [None, None]
    assert any("could not connect" in r.getMessage() for r in caplog.records)


def test_a_stranger_is_refused_and_the_follower_still_joins() -> None:
    import socket

    size = 2
    ranks = ThreadRanks(size)
    total0, total1 = ranks.total(0), ranks.total(1)
    offered: list[int] = []

    def follower_total(values: list[int]) -> list[int]:
        result = total1(values)
        if not offered:
            offered.extend(result)
            # A stranger reaches the port first, with the wrong nonce.
            with socket.create_connection((LOOPBACK, result[0]), timeout=5) as stranger:
                stranger.sendall(wakeup_module._HELLO.pack(1, result[1] ^ 1, result[2]))
        return result

    with ThreadPoolExecutor(size) as pool:
        a = pool.submit(open_wakeup, 0, size, total0, LOOPBACK)
        b = pool.submit(open_wakeup, 1, size, follower_total, LOOPBACK)
        rank0, follower = a.result(timeout=60), b.result(timeout=60)
    assert rank0 is not None and follower is not None
    rank0.notify()
    follower.wait()
    rank0.close()
    follower.close()
