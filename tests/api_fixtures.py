"""Shared helpers of the API tests: a real uvicorn server on 127.0.0.1 in a thread."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from server_health import wait_healthy

from mlxserve.api.serve import build_app
from mlxserve.bench.launcher import free_loopback_ports
from mlxserve.cli import build_parser
from mlxserve.models.loaded import LoadedModel


def free_port() -> int:
    return free_loopback_ports()


def serve_args(*extra: str, model: str = "test-model") -> argparse.Namespace:
    """`mlxserve serve` arguments as the CLI parses them."""
    return build_parser().parse_args(["serve", model, "--port", str(free_port()), *extra])


class ServerThread:
    """uvicorn serving the real app (real AsyncEngine) in a background thread."""

    def __init__(self, args: argparse.Namespace, loader: Callable[[], LoadedModel] | None) -> None:
        import uvicorn

        self.args = args
        self.app, self.served = build_app(args, loader=loader)
        self.state = self.served.default
        config = uvicorn.Config(
            self.app,
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, ready_timeout: float = 120.0, wait_ready: bool = True) -> ServerThread:
        """Start serving; return once the model is ready (or only listening: `wait_ready`)."""
        self.thread.start()
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            engines = [state.engine for state in self.served.models]
            if self.server.started and (all(e.ready for e in engines) or not wait_ready):
                return self
            for engine in engines:
                # (Not waiting for readiness, a failed load is what the caller looks at.)
                if wait_ready and engine.load_error is not None:
                    raise RuntimeError(engine.load_error)
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died")
            time.sleep(0.05)
        raise TimeoutError("the server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def post(url: str, path: str, body: Any = None, content: bytes | None = None, **kw: Any) -> Any:
    with httpx.Client(base_url=url, timeout=60) as client:
        if content is not None:
            return client.post(path, content=content, **kw)
        return client.post(path, json=body, **kw)


def assert_error_shape(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return dict(err)


def chat_body(content: str = "Hello", **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "test-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    body.update(kw)
    return body


class ServeProcess:
    """`mlxserve serve ...` as its own process on 127.0.0.1 (what a user runs)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        import sys

        self.port = free_port()
        self.argv = [sys.executable, "-m", "mlxserve.cli", "serve", *args, "--port", str(self.port)]
        self.env = env
        self.proc: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServeProcess:
        import subprocess

        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=self.env
        )
        stderr = self.proc.stderr
        try:
            wait_healthy(self.url, self.proc, describe_exit=lambda: stderr.read() if stderr else "")
        except TimeoutError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


def scripted_server(script: Any, *extra: str, model: str = "scripted-v4") -> ServerThread:
    """A server over the in-process scripted DeepSeek-V4 model, with its parsers pinned."""
    from mlxserve.models.tiny.scripted import scripted_model

    args = serve_args(
        "--served-model-name",
        model,
        "--tool-call-parser",
        "deepseek_v4",
        "--reasoning-parser",
        "deepseek_v4",
        *extra,
    )
    return ServerThread(args, lambda: scripted_model(script))


def history_message(msg: Any) -> dict[str, Any]:
    """An `openai` chat reply as the assistant message a client sends back next turn."""
    calls = [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments},
        }
        for call in msg.tool_calls or []
    ]
    out: dict[str, Any] = {
        "role": "assistant",
        "content": msg.content,
        "reasoning_content": getattr(msg, "reasoning_content", None),
    }
    if calls:
        out["tool_calls"] = calls
    return out


def serve_in_thread(
    args: argparse.Namespace, loader: Callable[[], LoadedModel]
) -> tuple[Any, threading.Thread, list[int]]:
    """`serve_app` (what `mlxserve serve` runs) in a thread: its state, the thread, and
    the list its exit status lands in; returns once the model is ready."""
    from mlxserve.api.serve import serve_app

    app, served = build_app(args, loader=loader)
    state = served.default
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(serve_app(app, served, args.host, args.port, "warning")),
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + 120
    while not state.engine.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    return state, thread, result


def metric(text: str, sample: str, **labels: str) -> float | None:
    """The value of the /metrics sample `sample` whose labels include `labels` (else None)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
