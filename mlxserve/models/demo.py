"""The embedded demo model: a tiny random-weight DeepSeek-V4 checkpoint, built once."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_FAMILY = "deepseek_v4"
DEMO_SEED = 0
RANDOM_WEIGHTS_NOTICE = (
    "the demo model has RANDOM weights: it runs the real DeepSeek-V4 architecture and "
    "tokenizer, but its text is noise"
)


def demo_model_path() -> Path:
    """Path of the cached demo checkpoint, writing it on first use."""
    from mlxserve.models.synthetic import build_config, make_model

    root = Path(os.environ.get("MLXSERVE_CACHE_DIR", Path.home() / ".cache" / "mlxserve"))
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
