"""Shared fixtures: tiny seeded checkpoints, built once per test session."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from mlxserve.models.loaded import LoadedModel

# Property tests draw the same examples on every run, so a red CI run reproduces.
settings.register_profile("derandomized", derandomize=True)
settings.load_profile("derandomized")

# Every HTTP client the tests make (httpx, openai, anthropic) talks to loopback over
# plain HTTP, yet httpx parses certifi's whole bundle for each client it builds (about
# 20 ms of CPU each, thousands of times a run). An empty certificate folder makes that
# free; it is inherited by the servers the tests start, and OpenSSL's default file still
# verifies what a test's `pip download` fetches.
os.environ.setdefault("SSL_CERT_DIR", tempfile.mkdtemp(prefix="mlxserve-tests-no-certs-"))

# One mlxserve cache folder for the run (a test that needs its own sets it): the servers
# the tests start keep each checkpoint's measured cache cost there, so a checkpoint is
# measured once a run, not once a server (DeepSeek-V4's probe is seconds of CPU).
os.environ.setdefault("MLXSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="mlxserve-tests-cache-"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `mlx.launch` tests first (their one module is the longest to run): a test
    worker starts them at once while the others share out the rest, instead of one
    worker starting them last and running on alone."""
    items.sort(key=lambda item: item.get_closest_marker("distributed") is None)


@pytest.fixture(scope="session")
def model_dir_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(family, seed=0, layers=None, hidden=None)` -> checkpoint dir (cached)."""
    from mlxserve.models.tiny.synthetic import make_model

    built: dict[tuple, Path] = {}

    def factory(
        family: str, seed: int = 0, layers: int | None = None, hidden: int | None = None
    ) -> Path:
        key = (family, seed, layers, hidden)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{family}-s{seed}")
            built[key] = make_model(out, family, seed=seed, layers=layers, hidden=hidden)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def loaded_factory(model_dir_factory: Callable[..., Path]) -> Callable[[str], LoadedModel]:
    """`factory(family)` -> LoadedModel of the seed-0 checkpoint (cached)."""
    from mlxserve.models.load import load

    cache: dict[str, LoadedModel] = {}

    def factory(family: str) -> LoadedModel:
        if family not in cache:
            cache[family] = load(model_dir_factory(family))
        return cache[family]

    return factory


@pytest.fixture(scope="session")
def swa_model_dir(model_dir_factory: Callable[..., Path], tmp_path_factory) -> Path:
    """A llama checkpoint whose first layer uses an 8-token sliding window (RotatingKVCache)."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("llama-swa")
    shutil.copytree(model_dir_factory("llama"), out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    config["sliding_window"] = 8
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA checkpoint (`make-model --family llama --vision`)."""
    from vision_helpers import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("llava") / "tiny")


@pytest.fixture(scope="session")
def oracle(vision_dir: Path) -> Any:
    """mlx-vlm's own greedy generation on `vision_dir` (`vision_helpers.Oracle`)."""
    from vision_helpers import Oracle

    return Oracle(vision_dir)


@pytest.fixture(scope="session")
def vision_model(vision_dir: Path) -> LoadedModel:
    from mlxserve.models.load import load

    return load(vision_dir)
