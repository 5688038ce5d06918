"""Shared fixtures: tiny seeded checkpoints, built once per test run (its workers share them)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from mlxserve.models.loaded import LoadedModel

# Property tests draw the same examples on every run, so a red CI run reproduces.
settings.register_profile("derandomized", derandomize=True)
settings.load_profile("derandomized")

# Every HTTP client the tests make (httpx, openai, anthropic) talks to loopback over
# plain HTTP, yet httpx loads a CA bundle for each client it builds: SSL_CERT_FILE's
# where the environment names one, else certifi's. That is 20-40 ms of CPU a client,
# thousands of times a run. An empty certificate folder in its place makes it free; the
# servers the tests start inherit it. Whatever uses OpenSSL's default paths still
# verifies against the system's bundle, and pip has its own (or PIP_CERT).
os.environ.pop("SSL_CERT_FILE", None)
os.environ["SSL_CERT_DIR"] = tempfile.mkdtemp(prefix="mlxserve-tests-no-certs-")

# Whether the mlxserve cache folder was chosen outside the tests (`run_cache_dir`).
_CACHE_DIR_GIVEN = "MLXSERVE_CACHE_DIR" in os.environ


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `mlx.launch` tests first (their one module is the longest to run): a test
    worker starts them at once while the others share out the rest, instead of one
    worker starting them last and running on alone."""
    items.sort(key=lambda item: item.get_closest_marker("distributed") is None)


def _run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every test worker of this run shares: xdist's workers' temp folders sit
    side by side in the run's own one (pytest keeps the last few runs' and removes older)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Held by one process of the run at a time (the workers' builds of one thing)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session", autouse=True)
def run_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mlxserve cache folder for the run, shared by its workers (a test that needs its
    own sets it): the engines and servers the tests start keep each checkpoint's measured
    cache cost there, so a checkpoint is measured once a run, not once a server or worker
    (DeepSeek-V4's probe is seconds of CPU)."""
    folder = Path(os.environ["MLXSERVE_CACHE_DIR"]) if _CACHE_DIR_GIVEN else None
    if folder is None:
        folder = _run_folder(tmp_path_factory) / "mlxserve-cache"
        folder.mkdir(exist_ok=True)
        os.environ["MLXSERVE_CACHE_DIR"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def model_dir_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(family, seed=0, layers=None, hidden=None)` -> checkpoint dir, built once a
    run: the test workers share it (the first to need it builds it, the others wait)."""
    from mlxserve.models.tiny.synthetic import make_model

    root = _run_folder(tmp_path_factory) / "checkpoints"
    root.mkdir(exist_ok=True)
    built: dict[tuple, Path] = {}

    def factory(
        family: str, seed: int = 0, layers: int | None = None, hidden: int | None = None
    ) -> Path:
        key = (family, seed, layers, hidden)
        if key not in built:
            name = f"{family}-s{seed}-l{layers}-h{hidden}"
            out = root / name
            with _locked(root / f"{name}.lock"):
                if not out.is_dir():  # a whole checkpoint: renamed into place once written
                    part = root / f"{name}.part{os.getpid()}"
                    make_model(part, family, seed=seed, layers=layers, hidden=hidden)
                    part.rename(out)
            built[key] = out
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
