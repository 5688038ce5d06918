"""Loading shows progress: by weight bytes in `load()`, on /health while it answers 503."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, serve_args

from mlxserve.models.loaded import LoadedModel
from mlxserve.models.progress import STAGES, LoadProgress


class _Recording(LoadProgress):
    def __init__(self) -> None:
        super().__init__(bar=False)
        self.seen: list[tuple[str, float]] = []

    def _draw(self, fraction: float, stage: str) -> None:
        self.seen.append((stage, fraction))


@pytest.mark.parametrize("family", ["llama", "deepseek_v4"])
def test_load_reports_weight_bytes(family: str, model_dir_factory: Callable[..., Path]) -> None:
    from mlxserve.models.load import load

    progress = _Recording()
    load(model_dir_factory(family), progress=progress)
    stages = [stage for stage, _ in progress.seen]
    assert stages[0] == "module" and stages[-1] == "ready"
    assert stages.index("tokenizer") > stages.index("weights")
    fractions = [f for _, f in progress.seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    weights = [f for stage, f in progress.seen if stage == "weights"]
    # Slices of ~1/50 of the bytes; in a tiny model the embedding and lm_head
    # are each about half, so at least one step lies strictly between.
    assert any(STAGES["weights"] < f < STAGES["tokenizer"] for f in weights), weights
    assert weights[-1] == pytest.approx(STAGES["tokenizer"])


def test_progress_bar_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    progress = LoadProgress(bar=True)
    progress.enter("weights")
    progress.weights(1, 2)
    progress.enter("ready")
    err = capsys.readouterr().err
    assert "loading" in err and "100%" in err
    quiet = LoadProgress(bar=False)
    quiet.weights(1, 2)
    assert capsys.readouterr().err == "" and quiet.fraction == pytest.approx(0.5)


@pytest.mark.slow
def test_health_reports_the_fraction_while_loading(
    model_dir_factory: Callable[..., Any],
) -> None:
    from mlxserve.models import load

    path = model_dir_factory("llama")
    gate = threading.Event()
    holder: dict[str, Any] = {}

    def slow_loader() -> LoadedModel:
        progress = holder["server"].state.load_progress
        progress.enter("weights")
        progress.weights(40, 100)
        gate.wait(60)
        progress.enter("ready")
        return load(path)  # on the engine thread, which runs it

    server = ServerThread(serve_args(), slow_loader)
    holder["server"] = server
    server.start(wait_ready=False)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            deadline = time.monotonic() + 30
            body: dict[str, Any] = {}
            while time.monotonic() < deadline:
                response = http.get("/health")
                body = response.json()
                if body.get("stage") == "weights":
                    break
                time.sleep(0.02)
            assert response.status_code == 503
            assert body == {"status": "loading", "progress": 0.41, "stage": "weights"}
            gate.set()
            while not server.state.engine.ready and time.monotonic() < deadline:
                time.sleep(0.02)
            assert http.get("/health").json() == {"status": "ok"}
    finally:
        gate.set()
        server.stop()
