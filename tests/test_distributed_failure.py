"""A rank that dies mid-stream is engine death: every open request fails,
`/health` stops answering ok, and every rank exits (within 10 s)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from dist_helpers import LaunchedServer, health, launch_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not launch_available(), reason="mlx.launch is not installed"),
]

EXIT_WITHIN_S = 10.0


def _stream(url: str, prompt: str, first_token: threading.Event, outcome: list[str]) -> None:
    """Stream a long completion; `outcome` gets "finished" (a normal end) or "failed"."""
    body = {"prompt": prompt, "max_tokens": 4000, "temperature": 0, "stream": True}
    finished = False
    try:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", url + "/v1/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[len("data: ") :])
                if "error" in data:
                    break
                choice = data["choices"][0]
                if choice["text"]:
                    first_token.set()
                if choice.get("finish_reason") in ("stop", "length"):
                    finished = True
    except httpx.TransportError:
        pass  # the connection broke: failed, as long as it did not finish first
    finally:
        first_token.set()
    outcome.append("finished" if finished else "failed")


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "State:\tZ" in status


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_a_rank_killed_mid_stream_fails_every_request_and_every_rank_exits(
    mode: str, model_dir_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = model_dir_factory("llama")
    with LaunchedServer(
        path, mode, "--max-num-batched-tokens", "48", log=tmp_path / "launch.log"
    ) as server:
        pids = server.rank_pids()
        assert set(pids) == {0, 1}, pids
        events = [threading.Event(), threading.Event()]
        outcomes: list[str] = []
        threads = [
            threading.Thread(target=_stream, args=(server.url, prompt, event, outcomes))
            for prompt, event in zip(("A long story:", "Counting: 1, 2,"), events, strict=True)
        ]
        for thread in threads:
            thread.start()
        for event in events:
            assert event.wait(60), "no stream started"
        os.kill(pids[1], signal.SIGKILL)
        for thread in threads:
            thread.join(EXIT_WITHIN_S)
        assert outcomes == ["failed", "failed"]
        # Rank 0 reports the death (503) until mlx.launch or --exit-on-engine-failure ends it.
        assert health(server.url) in (503, None)
        assert server.proc is not None
        server.proc.wait(timeout=EXIT_WITHIN_S)
        assert all(_gone(pid) for pid in pids.values()), pids
