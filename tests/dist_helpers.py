"""Helpers of the distributed tests: `mlx.launch --backend ring -n 2` on loopback.

`LaunchedServer` runs `mlxserve serve MODEL --distributed MODE` on two ranks
of this machine (127.0.0.1 only), each pinned to a core of its own as ranks on
machines of their own would be (`pin_rank.py`: a rank waiting on a collective
busy-polls; sharing the cores, the tiny DeepSeek-V4's tensor-parallel launch
took 37-59 s where pinned it took 21 s); `scenarios` drives one server through the
issue's cases and returns what it answered, so a single-process server's
answers can be compared with a distributed one's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from api_fixtures import free_port
from server_health import health_status, wait_healthy

from mlxserve.bench.launcher import loopback_launch, mlx_launch_path, start_launch

# Each rank runs on a core of its own (see pin_rank.py).
PIN_RANK = Path(__file__).with_name("pin_rank.py")
# Stream chunks a client reads before it goes away (abort / disconnect cases).
READ_BEFORE_LEAVING = 3


def launch_available() -> bool:
    return Path(mlx_launch_path()).is_file()


class LaunchedServer:
    """Two ranks under mlx.launch; rank 0 serves HTTP on 127.0.0.1."""

    def __init__(self, model: Path, mode: str, *extra: str, log: Path) -> None:
        self.port = free_port()
        self.argv = loopback_launch(
            sys.executable,
            str(PIN_RANK),
            sys.executable,
            "-m",
            "mlxserve.cli",
            "serve",
            str(model),
            "--distributed",
            mode,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            os.environ.get("MLXSERVE_DIST_LOG_LEVEL", "warning"),
            *extra,
        )
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LaunchedServer:
        self._log_file = self.log.open("wb")
        self.proc = start_launch(
            self.argv,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_healthy(self.url, self.proc, describe_exit=lambda: self.log.read_text()[-3000:])
        except TimeoutError:
            self.__exit__()
            raise
        return self

    def rank_pids(self) -> dict[int, int]:
        """The ranks' process ids (found by their environment and our port)."""
        found: dict[int, int] = {}
        marker = str(self.port).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"mlxserve.cli" not in cmdline or marker not in cmdline:
                continue
            for item in environ:
                if item.startswith(b"MLX_RANK="):
                    found[int(item.split(b"=", 1)[1])] = int(entry.name)
        return found

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self._log_file.close()


# About 320 tokens: six chunks of a 64-token step beside three decoding rows.
LONG_PROMPT = " ".join(f"item {i} of the list, then" for i in range(40))
SHORT_PROMPTS = ("The quick brown fox", "Once upon a time in a land", "1, 2, 3, 4,")
# One parameter: every token of a forced call is a step of its own, and a DSML
# parameter's markup alone is about 16 tokens. The value is still the model's choice.
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
    },
}


@dataclass
class Answer:
    text: str
    tokens: list[str] = field(default_factory=list)
    # Per token: the two highest log-probabilities (their gap is the logit gap).
    top2: list[tuple[float, float]] = field(default_factory=list)
    cached: int = 0
    finish: str | None = None


def complete(url: str, prompt: str, max_tokens: int = 12) -> Answer:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 2,
    }
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    data = response.json()
    choice = data["choices"][0]
    logprobs = choice["logprobs"]
    top2 = []
    for top in logprobs["top_logprobs"]:
        values = sorted(top.values(), reverse=True) + [float("-inf")]
        top2.append((values[0], values[1]))
    cached = data["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return Answer(choice["text"], logprobs["tokens"], top2, cached, choice["finish_reason"])


def tool_call(url: str) -> str:
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 120,
        # Random weights never close a reasoning block: constrain from the first token.
        "chat_template_kwargs": {"thinking": False, "enable_thinking": False},
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    assert len(calls) == 1, message
    for call in calls:
        call.pop("id", None)
    return json.dumps([calls, choice["finish_reason"]])


def stream_then_leave(url: str, prompt: str) -> list[str]:
    """Stream a completion, read a few chunks, then close the connection."""
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True}
    pieces: list[str] = []
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            if choice["text"]:
                pieces.append(choice["text"])
            if len(pieces) >= READ_BEFORE_LEAVING:
                break
    return pieces


def scenarios(url: str) -> dict[str, Any]:
    """The issue's cases on one server, in order; what it answered."""
    out: dict[str, Any] = {}
    prompts = [*SHORT_PROMPTS, LONG_PROMPT]
    with ThreadPoolExecutor(len(prompts)) as pool:
        out["batch"] = list(pool.map(lambda p: complete(url, p), prompts))
    # The long prompt's snapshot is in the prefix cache: this one extends it.
    out["hit"] = complete(url, LONG_PROMPT + " and one more thing")
    out["tool"] = tool_call(url)
    out["abort"] = stream_then_leave(url, SHORT_PROMPTS[1])
    out["disconnect"] = stream_then_leave(url, LONG_PROMPT + " again")
    # After a client left mid-stream, every rank must still be in step.
    out["after"] = complete(url, SHORT_PROMPTS[0] + " jumps", max_tokens=8)
    return out


def first_difference(a: Answer, b: Answer) -> int | None:
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)):
        if x != y:
            return i
    return None if len(a.tokens) == len(b.tokens) else min(len(a.tokens), len(b.tokens))


def assert_same_answers(
    reference: Answer, got: Answer, near_tie: float, where: str, tie_ok: bool
) -> None:
    """Identical greedy tokens; or, where `tie_ok` (tensor parallel sums in another
    order), a first difference at a step whose top-2 logit gap is below `near_tie`."""
    at = first_difference(reference, got)
    if at is None:
        return
    gap = reference.top2[at][0] - reference.top2[at][1] if at < len(reference.top2) else None
    message = f"{where}: token {at} differs ({reference.tokens!r} vs {got.tokens!r}; gap {gap})"
    assert tie_ok and gap is not None and gap < near_tie, message


def run_pool(jobs: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return [f.result() for f in [pool.submit(job) for job in jobs]]


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


def _open_two_streams(server: LaunchedServer) -> tuple[list[threading.Thread], list[str]]:
    """Two long streams, each past its first token; `outcomes` fills as they end."""
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
    return threads, outcomes


@contextmanager
def saturated_cores(count: int = 2) -> Iterator[None]:
    """`count` busy loops (one per core of this machine) for the block's duration."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(timeout=30)


def kill_rank_under_load(server: LaunchedServer, victim: int) -> None:
    """With every core saturated and two streams open, kill rank `victim`: every rank
    and mlx.launch are gone within `EXIT_WITHIN_S` of the kill (a deadline, checked by
    polling the processes), and both streams failed. Rank 0 must not wait out a
    collective, uvicorn's graceful shutdown or its engine thread's join when its peer
    is gone; a follower must not wait for a plan that never comes."""
    pids = server.rank_pids()
    assert set(pids) == {0, 1}, pids
    with saturated_cores():
        threads, outcomes = _open_two_streams(server)
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        deadline = killed_at + EXIT_WITHIN_S
        assert server.proc is not None
        while time.monotonic() < deadline:
            if server.proc.poll() is not None and all(_gone(pid) for pid in pids.values()):
                break
            time.sleep(0.05)
    alive = {rank: pid for rank, pid in pids.items() if not _gone(pid)}
    launcher_alive = server.proc.poll() is None
    log = server.log.read_text(errors="replace")
    assert not alive and not launcher_alive, (
        f"{EXIT_WITHIN_S} s after rank {victim} died: ranks alive {alive}, "
        f"mlx.launch alive: {launcher_alive}\n{log[-3000:]}"
    )
    for thread in threads:
        thread.join(EXIT_WITHIN_S)
    assert outcomes == ["failed", "failed"]
    # mlx.launch names each rank that ended with a non-zero status (or a signal): rank 0
    # is killed itself or leaves non-zero when its peer is gone.
    assert "Node with rank 0 exited with code" in log or "rank 0 was killed" in log, log[-2000:]


def stall_a_rank_mid_stream(server: LaunchedServer, step_timeout_s: float) -> None:
    """Stop rank 1 (SIGSTOP) while two streams are open: a rank that stops answering.
    Rank 0's step watchdog declares the engine dead after `step_timeout_s` (the
    server's --step-timeout); both streams fail, `/health` is not ok any more, and
    once rank 1 is killed, as a supervisor would, every rank exits within
    `EXIT_WITHIN_S`."""
    pids = server.rank_pids()
    assert set(pids) == {0, 1}, pids
    threads, outcomes = _open_two_streams(server)
    os.kill(pids[1], signal.SIGSTOP)
    for thread in threads:
        thread.join(step_timeout_s + EXIT_WITHIN_S)
    # A stopped process takes no SIGTERM from mlx.launch: the supervisor kills it.
    os.kill(pids[1], signal.SIGKILL)
    assert outcomes == ["failed", "failed"]
    # Rank 0 reports the death (503) until mlx.launch or --exit-on-engine-failure ends it.
    assert health_status(server.url) in (503, None)
    assert server.proc is not None
    try:
        server.proc.wait(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        alive = {rank: pid for rank, pid in pids.items() if not _gone(pid)}
        log = server.log.read_text(errors="replace")[-3000:]
        raise AssertionError(f"mlx.launch still running; ranks alive: {alive}\n{log}") from None
    assert all(_gone(pid) for pid in pids.values()), pids
    log = server.log.read_text(errors="replace")
    assert "Node with rank 0 exited with code" in log or "rank 0 was killed" in log, log[-2000:]
