"""Server lifecycle: /health while the model loads, a failed load, loopback default."""

from __future__ import annotations

import threading

import httpx
import pytest
from api_fixtures import ServerThread, assert_error_shape, chat_body, serve_args

from mlxserve.cli import build_parser
from mlxserve.models.loaded import LoadedModel, ModelLoadError
from mlxserve.models.tiny.scripted import scripted_model

pytestmark = pytest.mark.slow


def test_serve_binds_to_loopback_by_default() -> None:
    args = build_parser().parse_args(["serve", "some-dir"])
    assert args.host == "127.0.0.1" and args.port == 8000


def test_health_is_503_while_loading_then_200() -> None:
    release = threading.Event()

    def slow_loader() -> LoadedModel:
        assert release.wait(timeout=60)
        return scripted_model("ok")

    srv = ServerThread(serve_args(), slow_loader).start(wait_ready=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            r = http.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "loading"}
            err = assert_error_shape(http.post("/v1/chat/completions", json=chat_body()), 503)
            assert err["code"] == "model_loading"
            release.set()
            for _ in range(200):
                if srv.state.engine.ready:
                    break
                threading.Event().wait(0.05)
            assert http.get("/health").status_code == 200
            assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200
    finally:
        release.set()
        srv.stop()


def test_failed_load_is_reported_not_hung() -> None:
    def broken_loader() -> LoadedModel:
        raise ModelLoadError("no weights in /nowhere")

    srv = ServerThread(serve_args(), broken_loader).start(wait_ready=False)
    try:
        for _ in range(200):
            if srv.state.engine.load_error is not None:
                break
            threading.Event().wait(0.05)
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            r = http.get("/health")
            assert r.status_code == 503 and "no weights" in r.json()["error"]
            err = assert_error_shape(http.post("/v1/chat/completions", json=chat_body()), 503)
            assert "no weights" in err["message"]
    finally:
        srv.stop()
