"""`mlxserve bench serve`: figures, JSON, and the side-by-side comparison."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_fixtures import ServerThread, serve_args

from mlxserve.bench.serve import LevelResult, RequestResult, ratios, summarize
from mlxserve.cli import main
from mlxserve.models import load
from mlxserve.models.tiny.synthetic import make_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"), "llama", seed=1)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    args = serve_args("--served-model-name", "bench-a", model=str(model_dir))
    with ServerThread(args, lambda: load(model_dir)) as srv:
        yield srv


def test_summary_and_ratios() -> None:
    level = LevelResult(
        concurrency=2,
        wall=2.0,
        results=[
            RequestResult(ttft=0.1, tpot=0.01, tokens=10, latency=0.2),
            RequestResult(ttft=0.3, tpot=0.03, tokens=30, latency=0.9),
            RequestResult(error="HTTP 500"),
        ],
    )
    s = summarize(level)
    assert s["errors"] == 1 and s["tokens"] == 40 and s["tokens_per_s"] == 20.0
    assert s["ttft_p50_ms"] in (100.0, 300.0) and s["ttft_p95_ms"] == 300.0
    r = ratios(s, {**s, "tokens_per_s": 10.0, "ttft_p50_ms": s["ttft_p50_ms"] * 2})
    assert r["tokens_per_s"] == 2.0 and r["ttft_p50"] == 2.0 and r["tpot_p50"] == 1.0


def test_bench_against_running_server_with_compare(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.json"
    argv = [
        "bench", "serve", "--url", server.url, "--compare", server.url,
        "--concurrency", "1,2", "--requests-per-level", "2", "--max-tokens", "4",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for key in ("c1.ttft_p50_ms=", "c2.ttft_p95_ms=", "c2.tpot_mean_ms=", "c2.tokens_per_s="):
        assert key in printed
    assert "c2.compare.tokens_per_s=" in printed and "c2.ratio.tokens_per_s=" in printed
    figures = json.loads(out.read_text())["figures"]
    assert figures["c1.errors"] == 0 and figures["c2.compare.errors"] == 0
    assert figures["c2.tokens"] > 0 and figures["c2.ratio.tokens_per_s"] > 0


def test_bench_starts_its_own_server(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "own.json"
    argv = [
        "bench", "serve", "--model", str(model_dir), "--concurrency", "2",
        "--requests-per-level", "2", "--max-tokens", "3", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["c2.errors"] == 0 and figures["c2.tokens"] > 0
